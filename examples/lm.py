"""The language-model example: a small GPT learning to write Python, byte by byte.

The corpus is real text that exists offline on every machine and that nobody here wrote: the
Python standard library's own source files (``sysconfig.get_paths()["stdlib"]``, every
``*.py`` below it except ``site-packages``, sorted by relative path; about 1,800 files and
31 MB on CPython 3.11). A file belongs to the held-out split when the first byte of the
SHA-256 of its relative path is below 26 (about 10 % of the files), so the split is stable
and does not depend on the order or number of files. Tokens are bytes (vocabulary 256).

A sample is a window of ``seq_len + 1`` bytes of its split's concatenated files: sample ``i``
is bytes ``[i * seq_len, i * seq_len + seq_len + 1)``, input the first ``seq_len``, target the
last ``seq_len``. The files are read once, on first use, into one bytes buffer per split and
process (the dataset itself pickles without it, so loader processes stay cheap); ``len`` comes
from the files' sizes. Every worker of a job must run the same Python version (the same
stdlib), as :func:`corpus_digest` shows.

The model is a GPT-style decoder: learned token and position embeddings, pre-LayerNorm
blocks (causal self-attention, a 4x GELU MLP), a final LayerNorm and an output layer tied to
the token embedding; no dropout, so a step does not depend on how the batch is split. The
default (``GPTConfig()``: 4 layers, d_model 256, 4 heads, 128-byte context) has 3.2 M
parameters; ``SHOAL_LM_LAYERS``, ``SHOAL_LM_D_MODEL``, ``SHOAL_LM_HEADS``, ``SHOAL_LM_SEQ_LEN``
and ``SHOAL_LM_LR`` change it (in every worker's environment).

:func:`evaluate` (the job's ``eval_fn``) reports the held-out loss (mean cross-entropy per
byte, in nats) on a fixed set of :data:`EVAL_WINDOWS` held-out windows, its perplexity and
bits per byte (a model that has learnt nothing: ln 256 = 5.55 nats, 8 bits per byte).

Run it on shoal with ``shoal submit examples/lm.yaml`` (entrypoint ``shoal.examples.lm:build``)
or locally, single process, with ``python -m shoal.examples.lm --steps 150``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
import os
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from shoal import TrainingSetup, envvars

VOCAB = 256
#: Files whose relative path hashes to a first byte below this are held out (~10 %).
HELDOUT_BELOW = 26
#: Held-out windows :func:`evaluate` scores (evenly spaced over the held-out split).
EVAL_WINDOWS = 64
WARMUP_STEPS = 20

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape and learning rate; defaults read ``SHOAL_LM_*`` from the environment."""

    layers: int = field(default_factory=lambda: int(envvars.LM_LAYERS.get()))
    d_model: int = field(default_factory=lambda: int(envvars.LM_D_MODEL.get()))
    heads: int = field(default_factory=lambda: int(envvars.LM_HEADS.get()))
    seq_len: int = field(default_factory=lambda: int(envvars.LM_SEQ_LEN.get()))
    lr: float = field(default_factory=lambda: float(envvars.LM_LR.get()))

    def __post_init__(self) -> None:
        if min(self.layers, self.d_model, self.heads, self.seq_len) <= 0:
            raise ValueError(f"GPTConfig: every size must be positive: {self}")
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig: d_model {self.d_model} is not a multiple of heads {self.heads}")


# --- the corpus -----------------------------------------------------------------------------
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """The split of a file, from its relative path alone."""
    return hashlib.sha256(relpath.encode()).digest()[0] < HELDOUT_BELOW


def corpus_files(split: str, root: Path | None = None) -> list[tuple[str, Path]]:
    """``(relative path, path)`` of the split's files (``train`` or ``heldout``), sorted by
    relative path (POSIX form, so the order is the same on every platform)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    files = [f for f in _all_files(str(root or stdlib_root())) if is_heldout(f[0]) == (split == "heldout")]
    if not files:
        raise FileNotFoundError(f"no *.py files for split {split!r} under {root or stdlib_root()}")
    return files


@functools.lru_cache(maxsize=4)
def _all_files(root: str) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # third-party code: not the corpus
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                if path.is_file():
                    out.append((path.relative_to(root).as_posix(), path))
    return sorted(out)


_BUFFERS: dict[tuple, bytes] = {}  # (split, root, max_bytes) -> the split's bytes, per process


def _read_split(split: str, root: Path, max_bytes: int | None) -> bytes:
    key = (split, str(root), max_bytes)
    if key not in _BUFFERS:
        parts, size = [], 0
        for _, path in corpus_files(split, root):
            data = path.read_bytes()
            parts.append(data)
            size += len(data)
            if max_bytes is not None and size >= max_bytes:
                break
        _BUFFERS[key] = b"".join(parts)[:max_bytes]
    return _BUFFERS[key]


def corpus_digest(split: str = "train", root: Path | None = None) -> str:
    """SHA-256 of a split's bytes: equal on two machines when their corpora are."""
    return hashlib.sha256(_read_split(split, root or stdlib_root(), None)).hexdigest()


class StdlibBytes(torch.utils.data.Dataset):
    """Map-style dataset of ``(input int64[seq_len], target int64[seq_len])`` byte windows of
    one split of the stdlib corpus (module docstring). ``max_bytes`` keeps only the first that
    many bytes of the split (small tests). Deterministic: the same index gives the same
    window on every machine with the same stdlib."""

    def __init__(self, split: str = "train", seq_len: int = 128, max_bytes: int | None = None,
                 root: Path | None = None) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.split, self.seq_len, self.max_bytes = split, seq_len, max_bytes
        self.root = root or stdlib_root()
        self._buf: bytes | None = None
        total = sum(p.stat().st_size for _, p in corpus_files(split, self.root))
        self.nbytes = total if max_bytes is None else min(total, max_bytes)
        self._len = (self.nbytes - 1) // seq_len
        if self._len <= 0:
            raise ValueError(f"split {split!r} has {self.nbytes} bytes: not one window of {seq_len + 1}")

    @property
    def buffer(self) -> bytes:
        if self._buf is None:
            buf = _read_split(self.split, self.root, self.max_bytes)
            if len(buf) != self.nbytes:
                raise RuntimeError(f"the stdlib corpus under {self.root} changed while in use "
                                   f"({len(buf)} bytes read, {self.nbytes} expected)")
            self._buf = buf
        return self._buf

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range 0..{self._len - 1}")
        window = np.frombuffer(self.buffer, dtype=np.uint8, count=self.seq_len + 1, offset=i * self.seq_len)
        w = torch.from_numpy(window.astype(np.int64))
        return w[:-1], w[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_buf": None}  # loader processes read the files themselves


# --- the model ------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level decoder: ``forward(tokens int64[B, T]) -> logits float[B, T, 256]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(VOCAB, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialisation; residual projections scaled by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # the tied weight once


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The SUM over samples of each sample's mean cross-entropy per byte (shoal divides by
    the global batch, so the step's loss is the mean per byte)."""
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    return per_token / targets.shape[1]


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


# --- evaluation -----------------------------------------------------------------------------
_HELDOUT: dict[int, StdlibBytes] = {}


def evaluate(model: nn.Module, windows: int = EVAL_WINDOWS) -> dict[str, float]:
    """Mean cross-entropy per byte (nats) on ``windows`` fixed held-out windows, evenly
    spaced over the held-out split, with its perplexity and bits per byte."""
    seq_len = model.pos.num_embeddings if isinstance(model, GPT) else GPTConfig().seq_len
    if seq_len not in _HELDOUT:
        _HELDOUT[seq_len] = StdlibBytes("heldout", seq_len)
    data = _HELDOUT[seq_len]
    picks = np.linspace(0, len(data) - 1, min(windows, len(data))).astype(np.int64)
    device = next(model.parameters()).device
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(picks), 16):
            x, y = torch.utils.data.default_collate([data[int(i)] for i in picks[start : start + 16]])
            total += float(lm_loss(model(x.to(device)), y.to(device)))
    loss = total / len(picks)
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": loss / math.log(2)}


def build(cfg: GPTConfig | None = None, max_bytes: int | None = None) -> TrainingSetup:
    """The shoal entrypoint (``shoal.examples.lm:build``); ``cfg`` and ``max_bytes`` (the
    training split's first bytes only) are for tests and benches."""
    cfg = cfg or GPTConfig()
    model = GPT(cfg)
    optimizer = make_optimizer(model, cfg.lr)
    return TrainingSetup(
        model=model,
        optimizer=optimizer,
        dataset=StdlibBytes("train", cfg.seq_len, max_bytes=max_bytes),
        loss_fn=lm_loss,
        # linear warm-up, then constant (stepped once per committed step)
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS)),
        eval_fn=evaluate,
        tokens_per_sample=cfg.seq_len,  # a sample is seq_len bytes, each a token: status shows tokens/s
    )


#: :func:`build_large`'s model: 12 blocks of d_model 1536 (340 M parameters; with their
#: gradients and AdamW's two moments 5.4 GB in fp32, per worker under data parallelism)
LARGE = dict(layers=12, d_model=1536, heads=16)


def build_large(max_bytes: int | None = None) -> TrainingSetup:
    """``shoal.examples.lm:build_large``: the same GPT at 340 M parameters, the example of a
    model sharded over a replica group (``shard_size: 2`` in ``examples/lm-hsdp.yaml``: each
    worker holds half of the parameters, gradients and optimizer state). ``SHOAL_LM_SEQ_LEN``
    and ``SHOAL_LM_LR`` still apply; the shape is :data:`LARGE` unless ``SHOAL_LM_LAYERS`` /
    ``SHOAL_LM_D_MODEL`` / ``SHOAL_LM_HEADS`` say otherwise."""
    shape = {k: int(os.environ.get(var) or LARGE[k]) for k, var in
             (("layers", envvars.LM_LAYERS), ("d_model", envvars.LM_D_MODEL), ("heads", envvars.LM_HEADS))}
    return build(GPTConfig(**shape), max_bytes=max_bytes)


def train_locally(steps: int = 300, global_batch: int = 16, eval_every: int = 25, seed: int = 0,
                  precision: str = "fp32", log=print) -> list[dict[str, float]]:
    """Train single-process with shoal's engine and data order (no Redis); the held-out
    metrics at step 0 and every ``eval_every`` steps, with the mean training loss since the
    last evaluation."""
    from shoal import DataOrder, StepEngine, load_entrypoint

    setup = load_entrypoint("shoal.examples.lm:build", seed)
    log(f"GPT {num_parameters(setup.model) / 1e6:.2f} M parameters {setup.model.cfg}; "
        f"train split {setup.dataset.nbytes / 1e6:.1f} MB = {len(setup.dataset)} windows")
    engine = StepEngine.from_setup(setup, require_group=False, precision=precision)
    order = DataOrder(len(setup.dataset), seed, global_batch)
    cursor, history, total, count, started = 0, [], 0.0, 0, time.monotonic()

    def report(step: int) -> None:
        metrics = {"step": step, "train_loss": total / count if count else float("nan"),
                   **engine.evaluate(setup.eval_fn)}
        log(f"step {step:4d}  {time.monotonic() - started:6.1f} s  train loss {metrics['train_loss']:.3f}  "
            f"held-out loss {metrics['loss']:.3f}  ({metrics['bits_per_byte']:.2f} bits/byte, "
            f"perplexity {metrics['perplexity']:.1f})")
        history.append(metrics)

    report(0)
    for step in range(1, steps + 1):
        batch = order.batch(cursor)
        result = engine.step(batch.indices, batch.count, generation=0)
        cursor = batch.next_cursor
        total, count = total + result.loss_sum, count + result.count
        if step % eval_every == 0 or step == steps:
            report(step)
            total, count = 0.0, 0
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="global batch (windows per step)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"], help="the job spec's precision")
    args = ap.parse_args()
    train_locally(args.steps, args.batch, args.eval_every, args.seed, args.precision)
