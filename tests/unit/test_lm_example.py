"""The language-model example (examples/lm.py): its corpus, dataset, model and job spec.

A tiny configuration (1 layer, d_model 32, 16-byte windows, the first 64 KB of the corpus)
keeps this fast: the dataset is byte-level and deterministic, the split stable, the loss
summed per sample, and a few single-process steps with shoal's engine reduce the loss of a
fixed batch.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch

from shoal.core.jobspec import load_spec
from shoal.examples import lm
from shoal.worker.engine import StepEngine
from shoal.worker.userapi import resolve_entrypoint, seed_everything

ROOT = Path(__file__).resolve().parents[2]
TINY = lm.GPTConfig(layers=1, d_model=32, heads=2, seq_len=16, lr=1e-2)
MAX_BYTES = 64_000


def tiny_setup(seed: int = 0):
    seed_everything(seed)
    setup = lm.build(TINY, max_bytes=MAX_BYTES)
    setup.validate()
    return setup


def test_the_split_is_stable_and_disjoint():
    train = lm.corpus_files("train")
    held = lm.corpus_files("heldout")
    assert train == sorted(train) and held
    assert not {rel for rel, _ in train} & {rel for rel, _ in held}
    assert all(lm.is_heldout(rel) for rel, _ in held)
    assert len(held) < len(train) / 4  # about a tenth
    assert not any("site-packages" in rel for rel, _ in train + held)
    digest = lm.corpus_digest("heldout")
    assert len(digest) == 64 and digest == lm.corpus_digest("heldout")


def test_dataset_is_byte_level_and_deterministic():
    data = tiny_setup().dataset
    assert data.nbytes == MAX_BYTES and len(data) == (MAX_BYTES - 1) // 16
    x, y = data[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    first_file = lm.corpus_files("train")[0][1].read_bytes()
    assert bytes(x.tolist()) == first_file[:16] and bytes(y.tolist()) == first_file[1:17]
    for i in (1, 7, len(data) - 1):
        x, y = data[i]
        assert torch.equal(x[1:], y[:-1])  # the target is the input shifted by one byte
        assert int(x.min()) >= 0 and int(x.max()) < lm.VOCAB
        assert x[0] == data[i - 1][1][-1]  # consecutive windows overlap by one byte
    again = lm.StdlibBytes("train", 16, max_bytes=MAX_BYTES)
    copied = pickle.loads(pickle.dumps(again))  # what a loader process receives: no buffer
    assert copied._buf is None
    for i in (0, 5, 1234):
        assert all(torch.equal(a, b) for a, b in zip(data[i], again[i]))
        assert all(torch.equal(a, b) for a, b in zip(data[i], copied[i]))
    with pytest.raises(IndexError):
        data[len(data)]


def test_loss_is_the_sum_of_per_sample_means():
    setup = tiny_setup()
    x, y = torch.utils.data.default_collate([setup.dataset[i] for i in range(4)])
    with torch.no_grad():
        logits = setup.model(x)
        whole = setup.loss_fn(logits, y)
        parts = sum(setup.loss_fn(logits[i : i + 1], y[i : i + 1]) for i in range(4))
        mean = torch.nn.functional.cross_entropy(logits.reshape(-1, lm.VOCAB), y.reshape(-1))
    assert torch.allclose(whole, parts) and torch.allclose(whole / 4, mean)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_few_steps_reduce_the_loss_of_a_fixed_batch(precision):
    setup = tiny_setup()
    engine = StepEngine.from_setup(setup, require_group=False, precision=precision)
    batch = list(range(8))
    results = [engine.step(batch, len(batch), generation=0) for _ in range(6)]
    losses = [r.loss for r in results]
    assert abs(losses[0] - math.log(lm.VOCAB)) < 0.5  # an untrained model: about uniform
    assert losses[-1] < losses[0] - 0.05, losses
    assert not any(r.skipped for r in results)  # fp16: the initial scale fits this model
    assert all(p.dtype == torch.float32 for p in setup.model.parameters())  # autocast: fp32 master weights


def test_same_seed_same_model():
    a, b = tiny_setup(3).model.state_dict(), tiny_setup(3).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok.weight"], tiny_setup(4).model.state_dict()["tok.weight"])


def test_evaluate_reports_held_out_loss_perplexity_and_bits():
    metrics = lm.evaluate(tiny_setup().model, windows=8)
    assert set(metrics) == {"loss", "perplexity", "bits_per_byte"}
    assert math.isclose(metrics["perplexity"], math.exp(metrics["loss"]))
    assert math.isclose(metrics["bits_per_byte"], metrics["loss"] / math.log(2))
    assert abs(metrics["loss"] - math.log(lm.VOCAB)) < 0.5


def test_config_from_environment(monkeypatch):
    monkeypatch.setenv("SHOAL_LM_LAYERS", "3")
    monkeypatch.setenv("SHOAL_LM_D_MODEL", "48")
    monkeypatch.setenv("SHOAL_LM_HEADS", "6")
    cfg = lm.GPTConfig()
    assert (cfg.layers, cfg.d_model, cfg.heads) == (3, 48, 6)
    with pytest.raises(ValueError):
        lm.GPTConfig(d_model=50, heads=4)
    model = lm.GPT(lm.GPTConfig(layers=1, d_model=32, heads=2, seq_len=8))
    assert model.head.weight is model.tok.weight  # tied: counted once
    assert lm.num_parameters(model) == sum(p.numel() for p in model.parameters())


def test_job_spec_validates():
    spec = load_spec(ROOT / "examples" / "lm.yaml")
    assert spec.entrypoint == "shoal.examples.lm:build" and spec.eval_every_steps
    resolve_entrypoint(spec.entrypoint)


def test_the_sharded_example_validates_and_its_tied_head_stays_in_the_roots_unit():
    from shoal.worker.sharded_engine import default_shard_units

    spec = load_spec(ROOT / "examples" / "lm-hsdp.yaml")
    assert spec.entrypoint == "shoal.examples.lm:build_large" and spec.shard_size == 2
    resolve_entrypoint(spec.entrypoint)
    model = lm.GPT(lm.GPTConfig(layers=2, d_model=32, heads=2, seq_len=8))
    units = default_shard_units(model)
    assert model.tok not in units and model.head not in units  # they share the tied weight
    assert list(model.blocks) == [u for u in units if isinstance(u, lm.Block)] and model.pos in units
