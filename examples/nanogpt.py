"""A small GPT in nanoGPT's style, written for shoal: character-level, trained on the Python
standard library's own source (present on every machine), runnable on a CPU in minutes.

``examples/nanogpt.yaml`` runs it with ``compile: true`` (each worker compiles before it joins;
one fixed micro-batch shape, so a kill or a join never recompiles), hyperparameters in
``params:`` (passed to :func:`build`: ``shoal create examples/nanogpt.yaml --set params.lr=3e-4``),
a held-out split evaluated across the workers (``eval_dataset``: ``val_loss``, the same at any
world size) and the best checkpoint by ``val_loss`` kept besides the newest
(``checkpoint_keep_best``). ``examples/README.md`` shows the diff from a plain training loop.

The model is the usual decoder-only transformer: token and position embeddings, ``n_layer``
pre-norm blocks of causal self-attention and a 4x MLP, a final norm, and a head tied to the
token embedding. The loss is the SUM of per-token cross-entropies (shoal divides by the global
number of samples; the reported loss is per sample = per ``block_size`` tokens).
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from shoal import TrainingSetup


# --- data ---------------------------------------------------------------------------------------
def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's ``.py`` files, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class Blocks(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block_size + 1`` bytes: ``(input, target)`` = the window
    without its last byte, and shifted by one."""

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size
        #: tokens per sample (what tokens/s counts)
        self.tokens_per_sample = block_size

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.block_size: i * self.block_size + self.block_size + 1]
        return chunk[:-1], chunk[1:]


# --- the model ----------------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The SUM of the per-token cross-entropies, divided by the tokens of a sample: a
    per-sample sum (shoal divides by the global number of samples)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction="sum") / targets.shape[1]


# --- the entrypoint -----------------------------------------------------------------------------
def build(n_layer: int = 4, n_head: int = 4, n_embd: int = 128, block_size: int = 64, dropout: float = 0.0,
          lr: float = 1e-3, weight_decay: float = 0.1, warmup: int = 20, max_bytes: int = 1_000_000,
          val_fraction: float = 0.1) -> TrainingSetup:
    """The shoal entrypoint: every keyword argument can be set by the job spec's ``params``."""
    data = torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8).long()
    split = int(len(data) * (1 - val_fraction))
    train, val = Blocks(data[:split], block_size), Blocks(data[split:], block_size)
    model = GPT(256, block_size, n_layer, n_head, n_embd, dropout)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    return TrainingSetup(model=model, optimizer=optimizer, lr_scheduler=schedule, dataset=train, loss_fn=token_loss,
                         eval_dataset=val, eval_sums=lambda m, batch: {"loss": token_loss(m(batch[0]), batch[1])},
                         eval_batch_size=32)
