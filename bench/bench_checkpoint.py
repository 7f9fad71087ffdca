#!/usr/bin/env python3
"""Checkpoint benchmark: async-save stall and local save throughput vs raw disk bandwidth.

    python3 scripts/dev.py python bench/bench_checkpoint.py [--size-mb 128] [--repeats 5] [--dir DIR]

Metrics (median of ``--repeats`` runs, default 5, state of ``--size-mb`` MiB of float32 tensors:
half model weights, half two Adam-style moment buffers):

* async stall = time ``AsyncCheckpointer.save_async`` holds the training thread (the CPU
  snapshot) / time of a synchronous ``save_checkpoint`` of the same state. Target <= 0.10.
* save throughput ratio = bytes of state files / synchronous save time, divided by the raw
  fsync'd write bandwidth of ``dd if=/dev/zero of=DIR/dd.bin bs=1M count=N conv=fsync``
  measured in the same run on the same directory. Target >= 0.5.

Each repeat runs dd, the sync save and the async save back to back; both ratios are
computed within a repeat and the median over repeats is reported.

Everything is written under ``--dir`` (default: a fresh temp dir, removed at the end).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

import torch

from shoal.storage.async_saver import AsyncCheckpointer
from shoal.storage.checkpoint import save_checkpoint
from shoal.storage.local import LocalStore
from shoal.storage.train_state import TrainState

MiB = 1024 * 1024


def make_state(size_mb: int, step: int) -> TrainState:
    """``size_mb`` MiB of float32: model = 1/2, optimizer moments = 1/4 + 1/4."""
    n_layers = 8
    per_layer = size_mb * MiB // 2 // n_layers // 4  # float32 elements per weight tensor
    torch.manual_seed(step)
    model = {f"layer{i}.weight": torch.randn(per_layer) for i in range(n_layers)}
    opt_state = {
        i: {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.randn(per_layer // 2),
            "exp_avg_sq": torch.rand(per_layer // 2),
        }
        for i in range(n_layers)
    }
    return TrainState(
        step=step,
        model=model,
        optimizer={"state": opt_state, "param_groups": [{"lr": 1e-3, "params": list(range(n_layers))}]},
        data_cursor={"sample": step * 1024},
    )


def _tensors(state: TrainState) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack: list[object] = [state.model, state.optimizer]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


def dd_bandwidth(directory: Path, count_mb: int) -> float:
    """Bytes/s of ``dd ... conv=fsync`` writing ``count_mb`` MiB into ``directory``."""
    target = directory / "dd.bin"
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count_mb}", "conv=fsync"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    wall = time.perf_counter() - t0
    target.unlink()
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    seconds = float(m.group(1)) if m else wall
    return count_mb * MiB / seconds


def sync_save(store: LocalStore, state: TrainState) -> tuple[float, int]:
    t0 = time.perf_counter()
    manifest = save_checkpoint(store, state, keep_last=1, hmac_key=None)
    seconds = time.perf_counter() - t0
    return seconds, sum(f.size for f in manifest.files.values())


def async_save(saver: AsyncCheckpointer, state: TrainState, timeout_s: float) -> tuple[float, float]:
    """(seconds the caller was blocked, seconds until the background save finished)."""
    t0 = time.perf_counter()
    started = saver.save_async(state)
    blocked = time.perf_counter() - t0
    if not started:
        raise RuntimeError("a save was still in flight")
    if not saver.wait(timeout_s):
        raise RuntimeError(f"async save did not finish within {timeout_s} s")
    if saver.last_error is not None:
        raise RuntimeError(f"async save failed: {saver.last_error}")
    return blocked, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=128, help="state size in MiB (>= 100 for the targets)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="directory on the disk to measure")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-save timeout in seconds")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="shoal-bench-", dir=args.dir))
    try:
        state = make_state(args.size_mb, step=1)
        sync_store = LocalStore(work / "sync")
        saver = AsyncCheckpointer(LocalStore(work / "async"), keep_last=1, hmac_key=None)
        sync_save(sync_store, state)  # warm-up: allocator, page cache, imports
        async_save(saver, state, args.timeout)

        # Each repeat measures dd, the sync save and the async save back to back; the ratios
        # are taken within a repeat (paired), then the median over repeats, so that slow
        # drifts of a shared disk or CPU do not land on one side of a ratio only.
        sync_s, blocked_s, background_s, dd_bw = [], [], [], []
        nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
        for i in range(args.repeats):
            dd_bw.append(dd_bandwidth(work, max(1, round(nbytes / MiB))))
            state.step = 2 + i
            seconds, nbytes = sync_save(sync_store, state)
            sync_s.append(seconds)
            blocked, total = async_save(saver, state, args.timeout)
            blocked_s.append(blocked)
            background_s.append(total)
        saver.close(args.timeout)

        sync_med = statistics.median(sync_s)
        blocked_med = statistics.median(blocked_s)
        dd_med = statistics.median(dd_bw)
        save_bw = nbytes / sync_med
        stall = statistics.median(b / s for b, s in zip(blocked_s, sync_s, strict=True))
        tput = statistics.median(nbytes / s / d for s, d in zip(sync_s, dd_bw, strict=True))
        def verdict(ok: bool) -> str:
            return "PASS" if ok else "FAIL"

        def ms(xs: list[float]) -> str:
            return f"{min(xs) * 1000:.0f}-{max(xs) * 1000:.0f} ms"

        rows = [
            ("state size", f"{nbytes / MiB:.1f} MiB", ""),
            ("sync save_checkpoint (local, fsync)", f"{sync_med * 1000:.0f} ms", ms(sync_s)),
            ("async: training blocked (snapshot)", f"{blocked_med * 1000:.1f} ms", ms(blocked_s)),
            ("async: background save done after", f"{statistics.median(background_s) * 1000:.0f} ms", ms(background_s)),
            ("async stall ratio (blocked / sync, paired)", f"{stall:.3f}", f"target <= 0.10: {verdict(stall <= 0.10)}"),
            ("save throughput", f"{save_bw / MiB:.0f} MiB/s", ""),
            ("raw dd conv=fsync bandwidth", f"{dd_med / MiB:.0f} MiB/s",
             f"{min(dd_bw) / MiB:.0f}-{max(dd_bw) / MiB:.0f} MiB/s"),
            ("throughput ratio (save / dd, paired)", f"{tput:.2f}", f"target >= 0.5: {verdict(tput >= 0.5)}"),
        ]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        w2 = max(len(r[2]) for r in rows)
        print(f"bench_checkpoint: {args.size_mb} MiB state, median of {args.repeats} runs, "
              f"torch {torch.__version__}, {os.cpu_count()} CPUs, dir {work.parent}")
        print(f"| {'metric'.ljust(w0)} | {'median'.rjust(w1)} | {'range / target'.ljust(w2)} |")
        print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|{'-' * (w2 + 2)}|")
        for name, value, note in rows:
            print(f"| {name.ljust(w0)} | {value.rjust(w1)} | {note.ljust(w2)} |")
        return 0 if stall <= 0.10 and tput >= 0.5 else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
