"""``shoal dataset pack`` / ``index`` / ``info``: directories and ``module:function`` sources,
local and on the real S3 server; bad input gives one line, a non-zero exit and leaves nothing."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tests.helpers import run_cli
from tests.storage import streaming_data
from tests.storage.support import make_s3_store, s3_env

from shoal.storage.local import LocalStore
from shoal.storage.streaming import StreamingDataset
from shoal.storage.streaming_pack import PackError, index_tars, pack


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **s3_env(), **extra}


def _one_line_error(res) -> str:
    assert res.returncode != 0, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shoal: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_pack_a_directory_locally(tmp_path: Path) -> None:
    src = tmp_path / "files"
    (src / "sub").mkdir(parents=True)
    files = {"a.txt": b"alpha", "sub/b.bin": os.urandom(5000), "sub/c.jpg": os.urandom(3000)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / ".hidden").write_bytes(b"skip me")
    out = tmp_path / "ds"
    res = run_cli(_env(), "dataset", "pack", str(src), str(out), "--shard-size", "4KiB")
    assert res.returncode == 0, res.stderr
    assert "packed 3 samples into 3 packed shards" in res.stdout
    ds = StreamingDataset(str(out), cache_dir=tmp_path / "cache")
    assert len(ds) == 3 and ds.shard_samples == [1, 1, 1]
    got = {ds[i]["name"]: ds[i]["data"] for i in range(3)}
    assert got == files
    info = run_cli(_env(), "dataset", "info", str(out))
    assert info.returncode == 0 and "3 samples, 3 shards" in info.stdout


@pytest.mark.parametrize("fmt", ["packed", "webdataset"])
def test_pack_a_python_iterable_to_s3(fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_env().items():
        monkeypatch.setenv(k, v)
    bucket = make_s3_store("unused").bucket  # a fresh, existing bucket
    uri = f"s3://{bucket}/sets/small"
    res = run_cli(_env(), "dataset", "pack", "tests.storage.streaming_data:small", uri,
                  "--format", fmt, "--shard-size", "10KB", "--shard-samples", "70")
    assert res.returncode == 0, res.stderr
    ds = StreamingDataset(uri, cache_dir=tmp_path / "cache")
    assert len(ds) == 300 and len(ds.shard_samples) > 3 and max(ds.shard_samples) <= 70
    for i in (0, 1, 150, 299):
        got, want = ds[i], streaming_data.sample(i)
        assert got["__key__"] == f"{i:09d}" and got["cls"] == want["cls"] and got["txt"] == want["txt"]
        assert np.array_equal(got["npy"], want["npy"]) and got["bin"] == want["bin"]
    assert ds.stats()["downloads"] == 3  # 0, 1 and 299 share shards 0 and the last; 150 its own


def test_bad_input_one_line_and_nothing_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        (["dataset", "pack", str(tmp_path / "missing"), str(out)], "neither a directory nor module:function"),
        (["dataset", "pack", "no_such_module:fn", str(out)], "cannot import no_such_module"),
        (["dataset", "pack", "tests.storage.streaming_data:nope", str(out)], "has no function nope"),
        (["dataset", "pack", "tests.storage.streaming_data:not_iterable", str(out)], "TypeError"),
        (["dataset", "pack", "tests.storage.streaming_data:raises_midway", str(out), "--shard-size", "2KiB"],
         "the source raised RuntimeError at sample 200: source broke at 200"),
        (["dataset", "pack", "tests.storage.streaming_data:unpackable", str(out), "--shard-size", "2KiB"],
         "sample 150: field 'bad': set is not a packable type"),
        (["dataset", "pack", "tests.storage.streaming_data:small", str(out), "--shard-size", "lots"],
         "--shard-size: expected a size"),
        (["dataset", "pack", "tests.storage.streaming_data:small", "ftp://x/y"], "unsupported storage URI"),
        (["dataset", "pack", "tests.storage.streaming_data:small", str(out), "--shard-samples", "0"],
         "--shard-samples: expected a positive integer"),
        (["dataset", "info", str(out)], f"no dataset directory {out}"),
        (["dataset", "index", str(out)], f"no dataset directory {out}"),
    ]
    for argv, expected in cases:
        line = _one_line_error(run_cli(_env(), *argv))
        assert expected in line, (argv, line)
        assert not out.exists(), (argv, sorted(out.rglob("*")))


def test_failed_pack_to_s3_leaves_no_object() -> None:
    store = make_s3_store("sets/broken")
    uri = f"s3://{store.bucket}/sets/broken"
    line = _one_line_error(run_cli(_env(), "dataset", "pack", "tests.storage.streaming_data:raises_midway", uri,
                                   "--shard-size", "2KiB"))
    assert "source broke at 200" in line
    assert store.list() == []


def test_pack_refuses_an_existing_dataset_and_writes_the_index_last(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ds")
    order: list[str] = []
    real_put = store.put_bytes

    def put(key: str, data: bytes) -> None:
        order.append(key)
        real_put(key, data)

    store.put_bytes = put  # type: ignore[method-assign]
    index = pack(streaming_data.samples(50), store, shard_size=2000)
    assert order[-1] == "index.json" and len(order) == len(index.shards) + 1 > 2
    with pytest.raises(PackError, match="already exists"):
        pack(streaming_data.samples(5), store)


def test_index_existing_webdataset_tars(tmp_path: Path) -> None:
    """Tars made by plain ``tarfile`` (as webdataset's writers do) get an index with offsets."""
    root = tmp_path / "wds"
    root.mkdir()
    for shard in range(2):
        with tarfile.open(root / f"part-{shard}.tar", "w") as tar:
            for i in range(5):
                for ext, data in (("cls", str(i).encode()), ("seg.png", os.urandom(700))):
                    info = tarfile.TarInfo(f"train/s{shard}_{i:03d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    res = run_cli(_env(), "dataset", "index", str(root))
    assert res.returncode == 0, res.stderr
    assert "indexed 10 samples in 2 webdataset shards" in res.stdout
    ds = StreamingDataset(str(root), cache_dir=tmp_path / "c")
    assert ds[7]["__key__"] == "train/s1_002" and ds[7]["cls"] == 2 and len(ds[7]["seg.png"]) == 700
    assert ds.get_remote(7)["seg.png"] == ds[7]["seg.png"]
    (root / "junk.tar").write_bytes(b"this is not a tar" * 100)
    with pytest.raises(Exception, match="junk.tar"):
        index_tars(LocalStore(root))


def test_verify_names_the_bad_shards(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ds")
    index = pack(streaming_data.samples(100), store, shard_size=2000)
    ok = run_cli(_env(), "dataset", "verify", str(tmp_path / "ds"))
    assert ok.returncode == 0 and f"{len(index.shards)} shards of" in ok.stdout, ok.stderr
    bad, gone = index.shards[1].name, index.shards[4].name
    data = bytearray(store.get_bytes(bad))
    data[-1] ^= 1
    store.put_bytes(bad, bytes(data))
    store.delete(gone)
    line = _one_line_error(run_cli(_env(), "dataset", "verify", str(tmp_path / "ds")))
    assert f"2 of {len(index.shards)} shards" in line and f"{bad}: sha256" in line and f"{gone}: missing" in line
