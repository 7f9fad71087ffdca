"""Local backend specifics: fsync of file and directory before a write returns, temporaries."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from shoal.storage.errors import StorageConfigError, StorageError
from shoal.storage.local import LocalStore


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    kinds: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        kinds.append("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return kinds


def test_write_fsyncs_file_before_rename_and_directory_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "root")
    s.put_bytes("existing/dir/x", b"1")
    kinds = _record_fsyncs(monkeypatch)
    s.put_bytes("existing/dir/y", b"2")
    assert kinds == ["file", "dir"]


def test_new_directories_are_fsynced_into_their_parents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "root")
    kinds = _record_fsyncs(monkeypatch)
    s.put_bytes("a/b/c/obj", b"x")
    # three new directories (a, b, c) each fsync'd into its parent, then the file, then c
    assert kinds == ["dir", "dir", "dir", "file", "dir"]


def test_temporaries_are_invisible_and_cleaned_on_failure(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "root")
    with pytest.raises(RuntimeError), s.open_write("d/obj") as f:
        f.write(b"partial")
        names = os.listdir(tmp_path / "root" / "d")
        assert len(names) == 1 and names[0].startswith(".tmp-obj.")
        assert s.list() == []
        raise RuntimeError("crash")
    assert os.listdir(tmp_path / "root" / "d") == []
    with pytest.raises(ValueError):
        s.put_bytes(".tmp-sneaky", b"x")


def test_disk_errors_are_translated_and_leave_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = LocalStore(tmp_path / "root")
    s.put_bytes("k", b"old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageError, match="ENOSPC") as info:
        s.put_bytes("k", b"new")
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert s.get_bytes("k") == b"old"
    assert os.listdir(tmp_path / "root") == ["k"]


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageConfigError):
        LocalStore(tmp_path / "file")


def test_keys_cannot_escape_the_root(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "root")
    for bad in ("../outside", "a/../../outside", "/etc/passwd"):
        with pytest.raises(ValueError):
            s.put_bytes(bad, b"x")
    assert not (tmp_path / "outside").exists()


def test_large_writes_are_flushed_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import shoal.storage.durable_file as durable_file

    flushed = threading.Event()
    threads: list[str] = []
    real = durable_file._fdatasync

    def spy(fd: int) -> None:
        threads.append(threading.current_thread().name)
        real(fd)
        flushed.set()

    monkeypatch.setattr(durable_file, "_fdatasync", spy)
    s = LocalStore(tmp_path / "root")
    chunk = os.urandom(durable_file.FLUSH_EVERY)
    with s.open_write("big") as f:
        f.write(chunk)
        assert flushed.wait(20), "no background flush after FLUSH_EVERY bytes"
        f.write(chunk)
    assert threads and all(name == "shoal-fdatasync" for name in threads)
    assert s.size("big") == 2 * len(chunk)


def test_failed_background_flush_fails_the_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import shoal.storage.durable_file as durable_file

    failed = threading.Event()

    def broken(fd: int) -> None:
        failed.set()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(durable_file, "_fdatasync", broken)
    s = LocalStore(tmp_path / "root")
    s.put_bytes("big", b"old")
    chunk = bytes(durable_file.FLUSH_EVERY)
    with pytest.raises(StorageError, match="EIO"), s.open_write("big") as f:
        f.write(chunk)
        assert failed.wait(20)
        f.write(chunk)
    assert s.get_bytes("big") == b"old"
    assert os.listdir(tmp_path / "root") == ["big"]
