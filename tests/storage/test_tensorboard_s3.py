"""TensorBoard event files to ``s3://bucket/prefix``: written locally, uploaded periodically and
at close through the S3 store (real S3 server: moto, via the minio client), and readable by
TensorBoard's reader once downloaded; the local temporary directory is removed."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shoal.worker.tensorboard import TensorBoardLog
from tests.helpers import wait_until
from tests.storage.support import make_s3_store, s3_env


def test_event_files_reach_s3_periodically_and_at_close(tmp_path, monkeypatch) -> None:
    for name, value in s3_env().items():
        monkeypatch.setenv(name, value)
    store = make_s3_store(prefix="tb/run1")  # a fresh bucket; the writer opens the same prefix
    before = set(Path(tempfile.gettempdir()).glob("shoal-tb-*"))
    tb = TensorBoardLog(f"s3://{store.bucket}/tb/run1", upload_every=0.2)
    tb.scalars(1, 2.0, 1, 1, [0.1], now=10.0)
    tb.text(1, "membership", "generation 1: world size 1 (w0)")
    (key,) = wait_until(lambda: store.list(""), 20, "the periodic upload")  # before close
    assert key.startswith("events.out.tfevents.")
    tb.scalars(2, 1.5, 1, 1, [0.1], now=11.0)
    tb.close()
    local = tmp_path / "down"
    local.mkdir()
    (local / key).write_bytes(store.get_bytes(key))
    acc = EventAccumulator(str(local), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]  # the upload at close has step 2
    assert acc.Tensors("membership/text_summary")
    assert set(Path(tempfile.gettempdir()).glob("shoal-tb-*")) == before  # temp dir removed
