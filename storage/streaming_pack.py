"""Write a streaming dataset: samples -> shards + index (``shoal dataset pack``), and index
existing WebDataset tars (``shoal dataset index``).



:func:`pack` cuts the samples into shards of at most ``shard_size`` bytes (a single larger
sample gets a shard of its own) and/or ``shard_samples`` samples, uploads each shard as it is complete, and writes the index
**last**: a dataset whose index exists is complete. When anything fails (a sample that cannot
be stored, the source raising, the store failing) the shards written so far are deleted and
no index is written. An output that already holds an index is refused. Every sample gets a
``__key__`` (its global id as 9 digits) unless it has one, so a packed and a WebDataset copy
of the same samples read back as the same dicts (fields named by their WebDataset type).

Sources (:func:`iter_source`): a directory (each regular file, in sorted path order, is one
sample ``{"__key__", "name": relative path, "data": bytes}``; hidden files are skipped) or
``module:function`` naming a callable with no arguments that returns an iterable of dicts (the
module must be importable: installed, on ``PYTHONPATH``, or in the current directory with
``python -m shoal dataset pack``).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from shoal.storage import streaming_format as packed
from shoal.storage import streaming_tar as wds
from shoal.storage.backend import ObjectStore
from shoal.storage.datasets import INDEX, DatasetIndex, ShardEntry, parse_index, shard_key
from shoal.storage.errors import ShardCorrupt, StorageConfigError, StorageError, translated

FORMATS = ("packed", "webdataset")
SUFFIX = {"packed": ".shoal", "webdataset": ".tar"}
DEFAULT_SHARD_SIZE = 64 * 1024 * 1024


class PackError(StorageConfigError):
    """Bad input to ``pack``: a source that does not exist or import, a sample that cannot be
    stored. Nothing was left in the output."""


def iter_source(source: str) -> Iterator[Mapping[str, Any]]:
    """Samples of a directory or a ``module:function`` (see the module docstring)."""
    path = Path(source)
    if path.is_dir():
        return _iter_dir(path)
    if ":" in source and not path.exists():
        return _iter_callable(source)
    raise PackError(f"source {source!r} is neither a directory nor module:function")


def _iter_dir(root: Path) -> Iterator[Mapping[str, Any]]:
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(dirpath) / n for n in names if not n.startswith(".")]
    for p in sorted(files, key=lambda q: q.relative_to(root).as_posix()):
        if p.is_file():
            with translated(f"read {p}"):
                data = p.read_bytes()
            yield {"name": p.relative_to(root).as_posix(), "data": data}


def _iter_callable(spec: str) -> Iterator[Mapping[str, Any]]:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise PackError(f"source {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: any error is a bad source
        raise PackError(f"source {spec!r}: cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise PackError(f"source {spec!r}: {module_name} has no function {func_name}")
    try:
        samples = func()
        return iter(samples)
    except Exception as exc:  # noqa: BLE001
        raise PackError(f"source {spec!r} raised {type(exc).__name__}: {exc}") from exc


def _keyed(samples: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    it = iter(samples)
    i = 0
    while True:
        try:
            sample = next(it)
        except StopIteration:
            return
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's iterable failed
            raise PackError(f"the source raised {type(exc).__name__} at sample {i}: {exc}") from exc
        if not isinstance(sample, Mapping):
            raise PackError(f"sample {i}: expected a dict of fields, got {type(sample).__name__}")
        out = dict(sample)
        out.setdefault(wds.KEY, f"{i:09d}")
        yield out
        i += 1


def pack(
    samples: Iterable[Mapping[str, Any]],
    store: ObjectStore,
    *,
    format: str = "packed",
    shard_size: int | None = DEFAULT_SHARD_SIZE,
    shard_samples: int | None = None,
    index_key: str = INDEX,
    progress: Callable[[int, int], None] | None = None,
) -> DatasetIndex:
    """Write ``samples`` as a dataset into ``store`` (see the module docstring). A shard is
    cut before it would exceed ``shard_size`` bytes or hold more than ``shard_samples``
    samples (either may be None, not both): with ``shard_samples`` alone, a packed and a
    WebDataset copy of the same samples get the same shard boundaries, hence the same
    shard-aware order.
    ``progress(samples, shards)`` is called after each shard. Raises PackError for bad input
    (naming the sample and field), StorageError when the store fails; either way the shards
    written are removed and no index exists."""
    if format not in FORMATS:
        raise PackError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    if shard_size is not None and shard_size <= 0:
        raise PackError(f"shard size must be a positive number of bytes, got {shard_size}")
    if shard_samples is not None and shard_samples <= 0:
        raise PackError(f"samples per shard must be positive, got {shard_samples}")
    if shard_size is None and shard_samples is None:
        raise PackError("give a shard size in bytes, a number of samples per shard, or both")
    max_bytes = shard_size if shard_size is not None else 2**63
    max_count = shard_samples if shard_samples is not None else 2**63
    if store.exists(index_key):
        raise PackError(f"{store.uri}/{index_key} already exists: pack into an empty location")
    written: list[str] = []
    entries: list[ShardEntry] = []
    try:
        buf: list[Any] = []
        size = 0
        total = 0
        for i, sample in enumerate(_keyed(samples)):
            try:
                item = packed.encode_sample(sample) if format == "packed" else _tar_item(sample)
            except packed.FormatError as exc:
                raise PackError(f"sample {i}: {exc}") from exc
            n = len(item) if format == "packed" else item[1]
            if buf and (size + n + (8 if format == "packed" else 0) > max_bytes or len(buf) >= max_count):
                entries.append(_flush(store, format, buf, len(entries), index_key, written))
                total += len(buf)
                if progress:
                    progress(total, len(entries))
                buf, size = [], 0
            buf.append(item if format == "packed" else item[0])
            size += n + (8 if format == "packed" else 0)
        if buf:
            entries.append(_flush(store, format, buf, len(entries), index_key, written))
            total += len(buf)
            if progress:
                progress(total, len(entries))
        index = DatasetIndex(shards=entries)
        store.put_bytes(index_key, index.model_dump_json().encode())
        return index
    except BaseException:
        for key in written:
            try:
                store.delete(key)
            except StorageError:
                pass
        raise


def _tar_item(sample: dict[str, Any]) -> tuple[dict[str, Any], int]:
    size = 0
    for field, value in sample.items():
        if field != wds.KEY:
            size += 512 + ((len(wds.encode_field(field, value)) + 511) // 512) * 512
    return sample, size


def _flush(store: ObjectStore, format: str, items: list[Any], number: int, index_key: str,
           written: list[str]) -> ShardEntry:
    name = f"shard-{number:05d}{SUFFIX[format]}"
    offsets: list[int] | None = None
    record_size: int | None = None
    if format == "packed":
        data = packed.build_shard(items)
        if len({len(rec) for rec in items}) == 1:  # fixed-size samples: ranged reads need no offsets
            record_size = len(items[0])
    else:
        try:
            data, offsets = wds.write_tar(items)
        except packed.FormatError as exc:
            raise PackError(f"shard {number}: {exc}") from exc
    key = shard_key(index_key, name)
    written.append(key)
    store.put_bytes(key, data)
    return ShardEntry(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      samples=len(items), format=format, offsets=offsets, record_size=record_size)


def index_tars(store: ObjectStore, *, index_key: str = INDEX, names: list[str] | None = None) -> DatasetIndex:
    """Write an index for the WebDataset tars under the index's directory (``*.tar``, sorted,
    or ``names``): each is read once, hashed, and scanned for its samples' offsets. An existing
    index is replaced (atomically). ShardCorrupt names a tar that is not a valid WebDataset
    shard; nothing is written then."""
    base = index_key.rpartition("/")[0]
    prefix = f"{base}/" if base else ""
    if names is None:
        names = [k[len(prefix):] for k in store.list(prefix) if k.endswith(".tar") and "/" not in k[len(prefix):]]
    if not names:
        raise PackError(f"no .tar shards under {store.uri}/{prefix}")
    import io

    entries = []
    for name in names:
        data = store.get_bytes(shard_key(index_key, name))
        try:
            offsets = wds.scan(io.BytesIO(data), len(data))
        except packed.FormatError as exc:
            raise ShardCorrupt(f"dataset shard {store.uri}/{shard_key(index_key, name)}: {exc}") from exc
        entries.append(ShardEntry(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                                  samples=len(offsets) - 1, format="webdataset", offsets=offsets))
    index = DatasetIndex(shards=entries)
    store.put_bytes(index_key, index.model_dump_json().encode())
    return index


def read_index(store: ObjectStore, index_key: str = INDEX) -> DatasetIndex:
    return parse_index(store.get_bytes(index_key), f"{store.uri}/{index_key}")


def verify_dataset(store: ObjectStore, index_key: str = INDEX) -> tuple[int, list[str]]:
    """Hash every shard of the dataset (streamed, never whole in memory) against its index:
    (shards checked, one problem per bad shard, naming it). Store failures other than a
    missing shard raise."""
    from shoal.storage.errors import ObjectNotFound

    index = read_index(store, index_key)
    problems = []
    for entry in index.shards:
        key = shard_key(index_key, entry.name)
        sha = hashlib.sha256()
        size = 0
        try:
            with translated(f"read {store.uri}/{key}"), store.open_read(key) as src:
                while chunk := src.read(8 << 20):
                    sha.update(chunk)
                    size += len(chunk)
        except ObjectNotFound:
            problems.append(f"{entry.name}: missing")
            continue
        if size != entry.size:
            problems.append(f"{entry.name}: {size} bytes, index says {entry.size}")
        elif sha.hexdigest() != entry.sha256:
            problems.append(f"{entry.name}: sha256 does not match the index")
    return len(index.shards), problems
