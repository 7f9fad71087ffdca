"""Rank 0's TensorBoard event files (the job spec's ``tensorboard_dir``).

:class:`TensorBoardLog` takes, on the training thread, only cheap calls that put a record on
a bounded queue (a full queue drops the record); one background thread owns the
``torch.utils.tensorboard.SummaryWriter`` and does all the writing. So writing never slows or
breaks a step: the first error (the ``tensorboard`` package missing, a full disk, S3 down) is
logged once, the writer stops, and training goes on.

What is written (tags):

- ``train/loss``, ``train/steps_per_s``, ``train/world_size``, ``train/generation``,
  ``train/lr`` (``train/lr/group<i>`` per optimizer parameter group when there are several):
  a point per committed step, at most one per ``interval`` seconds, plus the first step of
  every generation; steps/s is the committed steps of the last 30 s over the time they took
  (:func:`shoal.core.throughput.window_rate`, over the steps this worker saw committed);
- with the figures of :mod:`shoal.worker.flops` (:meth:`TensorBoardLog.figures`), at the same
  points: ``train/samples_per_s``, ``train/tokens_per_s`` (a dataset of token sequences),
  ``train/tflops`` (achieved TFLOP/s of the whole job) and ``train/mfu`` (0..1: over the peak
  of ``world_size`` devices like this worker's);
- ``eval/<metric>``: every evaluation rank 0 reports (``EvalReported``), at its step;
- ``membership`` (text): each generation this worker starts as rank 0, with the shard
  table's reason (who joined, failed or left).

Only the current rank 0 calls it, so only it writes; the writer (and its event file) is
created on the first record. A worker that becomes rank 0 after a failover writes its own
event file into the same directory: TensorBoard merges the files of one directory.
For ``s3://bucket/prefix`` the files are written to a temporary directory and uploaded
(whole, replacing the previous upload) every ``upload_every`` seconds and at :meth:`close`,
through :func:`shoal.storage.uri.open_store` (S3 settings from the environment).
"""

from __future__ import annotations

import logging
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from shoal.core.throughput import WINDOW_S, throughput, window_rate

log = logging.getLogger("shoal.worker.tensorboard")

#: Records waiting for the writer thread; more are dropped.
QUEUE_CAP = 10_000
#: The SummaryWriter's flush period: what a live TensorBoard lags behind, and what a rank 0
#: killed with SIGKILL loses of its local file.
FLUSH_SECS = 2
#: How long :meth:`TensorBoardLog.close` waits for the thread to flush (and upload).
CLOSE_TIMEOUT_S = 30.0

_STOP = object()


def missing_package() -> str | None:
    """The package a ``tensorboard_dir`` needs and this interpreter lacks ("tensorboard"), or None."""
    import importlib.util

    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a broken install, or blocked (``sys.modules[name] = None``)
        found = False
    return None if found else "tensorboard"


class TensorBoardLog:
    """Event files of one worker process in ``uri`` (see the module docstring). Every public
    method returns at once and never raises."""

    def __init__(self, uri: str, *, interval: float = 0.1, upload_every: float = 30.0):
        self.uri = uri
        self.interval = interval
        self.upload_every = upload_every
        self._queue: queue.Queue = queue.Queue(QUEUE_CAP)
        self._thread: threading.Thread | None = None
        #: set once writing stopped for good (an error, or closed after the last record)
        self.stopped = threading.Event()
        self._closed = False
        #: (monotonic time, step, generation) of the last scalar point queued
        self._last: tuple[float, int, int] | None = None
        #: (monotonic time, step) of the committed steps of about the last window
        self._window: deque[tuple[float, int]] = deque()
        #: what turns steps/s into samples/s, tokens/s, FLOP/s and MFU (:meth:`figures`)
        self._figures: dict[str, Any] = {}
        self.dropped = 0

    # ---- the training thread's side --------------------------------------------------------

    def scalars(self, step: int, loss: float | None, generation: int, world_size: int, lrs: list[float],
                now: float | None = None) -> None:
        """A committed step: queued when due (first of a generation, or ``interval`` passed)."""
        try:
            self._scalars(step, loss, generation, world_size, lrs, time.monotonic() if now is None else now)
        except (TypeError, ValueError, RuntimeError) as exc:  # an odd value (a tensor lr...): skip it
            self._give_up(f"step {step}: {type(exc).__name__}: {exc}")

    def figures(self, *, samples_per_step: int, flops_per_sample: float | None = None,
                peak_flops: float | None = None, tokens_per_sample: int | None = None) -> None:
        """What the next points turn steps/s into: the global batch, FLOPs of one sample's
        forward and backward, this worker's peak FLOP/s, tokens in one sample (None: unknown)."""
        self._figures = {"samples_per_step": samples_per_step, "flops_per_sample": flops_per_sample,
                         "peak_flops": peak_flops, "tokens_per_sample": tokens_per_sample}

    def _scalars(self, step: int, loss: float | None, generation: int, world_size: int, lrs: list[float],
                 now: float) -> None:
        window = self._window
        if window and step < window[-1][1]:  # resumed from an older checkpoint: start again
            window.clear()
        window.append((now, step))
        while len(window) > 2 and now - window[1][0] > WINDOW_S:
            window.popleft()
        last = self._last
        if last is not None and last[2] == generation and now - last[0] < self.interval:
            return
        self._last = (now, step, generation)
        rate = window_rate(window)
        values: dict[str, float] = {"train/world_size": world_size, "train/generation": generation}
        if loss is not None:
            values["train/loss"] = float(loss)
        if rate is not None:
            values["train/steps_per_s"] = rate.steps_per_s
            values.update(self._rates(rate.steps_per_s, world_size))
        if len(lrs) == 1:
            values["train/lr"] = float(lrs[0])
        else:
            values.update({f"train/lr/group{i}": float(lr) for i, lr in enumerate(lrs)})
        self._put(("scalars", step, values))

    def _rates(self, steps_per_s: float, world_size: int) -> dict[str, float]:
        f = self._figures
        if not f:
            return {}
        peak = f["peak_flops"] * world_size if f.get("peak_flops") else None
        t = throughput(steps_per_s, f["samples_per_step"], tokens_per_sample=f.get("tokens_per_sample"),
                       flops_per_sample=f.get("flops_per_sample"), peak_flops=peak)
        out = {"train/samples_per_s": t.samples_per_s}
        if t.tokens_per_s is not None:
            out["train/tokens_per_s"] = t.tokens_per_s
        if t.flops_per_s is not None:
            out["train/tflops"] = t.flops_per_s / 1e12
        if t.mfu is not None:
            out["train/mfu"] = t.mfu
        return out

    def metrics(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's metrics (finite floats, as ``EvalReported`` carries), as
        ``eval/<name>`` at ``step``."""
        self._put(("scalars", step, {f"eval/{k}": v for k, v in metrics.items()}))

    def text(self, step: int, tag: str, text: str) -> None:
        """A text event (a membership change) at ``step``."""
        self._put(("text", step, tag, text))

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush, upload (S3) and close; waits at most ``timeout`` s. Idempotent."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("TensorBoard writer did not finish within %.0f s; its last records may be missing", timeout)

    def _give_up(self, why: str) -> None:
        if not self.stopped.is_set():
            self.stopped.set()
            log.warning("TensorBoard: writing to %s stopped (%s); training goes on", self.uri, why)

    def _put(self, record: tuple) -> None:
        if self.stopped.is_set() or self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tensorboard", daemon=True)
            self._thread.start()
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    # ---- the writer thread -------------------------------------------------------------------

    def _run(self) -> None:
        writer = None
        local: Path | None = None
        store = None
        try:
            local, store = self._target()
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            writer = SummaryWriter(log_dir=str(local), flush_secs=FLUSH_SECS)
            next_upload = time.monotonic() + self.upload_every
            while True:
                wait = max(0.05, next_upload - time.monotonic()) if store is not None else 1.0
                try:
                    record = self._queue.get(timeout=wait)
                except queue.Empty:
                    record = None
                if record is _STOP:
                    break
                if record is not None:
                    self._write(writer, record)
                if store is not None and time.monotonic() >= next_upload:
                    writer.flush()
                    self._upload(local, store)
                    next_upload = time.monotonic() + self.upload_every
            writer.close()
            writer = None
            if store is not None:
                self._upload(local, store)
        except Exception as exc:  # noqa: BLE001 - reported once; training goes on
            self._give_up(_why(exc))
        finally:
            self.stopped.set()
            if writer is not None:
                try:
                    writer.close()
                except Exception:  # noqa: BLE001 - already reported
                    pass
            if store is not None and local is not None:
                shutil.rmtree(local, ignore_errors=True)

    def _target(self) -> tuple[Path, Any]:
        """The directory the SummaryWriter writes to, and the store to upload it to (None: local)."""
        if self.uri.startswith("s3://"):
            from shoal.storage.uri import open_store

            store = open_store(self.uri)
            return Path(tempfile.mkdtemp(prefix="shoal-tb-")), store
        path = Path(self.uri[len("file://"):] if self.uri.startswith("file://") else self.uri)
        path.mkdir(parents=True, exist_ok=True)
        return path, None

    @staticmethod
    def _write(writer: Any, record: tuple) -> None:
        kind, step = record[0], record[1]
        if kind == "scalars":
            for tag, value in record[2].items():
                writer.add_scalar(tag, value, step)
        else:
            writer.add_text(record[2], record[3], step)

    @staticmethod
    def _upload(local: Path, store: Any) -> None:
        for path in sorted(local.iterdir()):
            if path.is_file():
                store.put_file(path.name, path)


def _why(exc: BaseException) -> str:
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").startswith("tensorboard"):
        return "the tensorboard package is not installed: pip install 'shoal[tensorboard]'"
    return f"{type(exc).__name__}: {exc}"
