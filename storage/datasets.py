"""Sharded dataset files, fetched on demand from any store, verified, cached locally.

A dataset is a set of shard objects plus an index object (default ``index.json``) next to
them::

    {"format": 1, "shards": [{"name": "train-00000.bin", "size": 1048576, "sha256": "...",
                              "samples": 1000, "format": "packed"}]}

``samples`` (how many samples the shard holds), ``format`` (``packed``: shoal's own binary
format, :mod:`shoal.storage.streaming_format`; ``webdataset``: a tar of WebDataset samples)
and ``offsets`` (``samples + 1`` byte offsets: where each sample starts, then the end of the
last one; written for ``webdataset`` shards, whose tar has no offsets table of its own) are
optional: indexes without them still parse, and :class:`~shoal.storage.streaming.StreamingDataset`
requires the first two.

Shard names are keys relative to the index's directory. :class:`ShardReader` gives a local
path for a shard: for a local store the file itself (hashed once per reader), otherwise a
copy in ``cache_dir`` named by its sha256, downloaded on first use, verified, then renamed
into place atomically -- so a cache file that exists was verified when written (later reads
check only its size). A shard whose size or sha256 differs from the index raises
:class:`~storage.errors.ShardCorrupt` and is not cached. Shards are downloaded whole into
memory before verification.
"""

from __future__ import annotations

import hashlib
import posixpath
import threading
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shoal.storage.backend import ObjectStore, check_key
from shoal.storage.errors import ShardCorrupt, translated
from shoal.storage.local import LocalStore
from shoal.storage.manifest import HexDigest
from shoal.storage.streaming_format import shard_overhead
from shoal.events.validation import first_error

INDEX = "index.json"
_CHUNK = 8 * 1024 * 1024


class ShardEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str
    size: int = Field(ge=0)
    sha256: HexDigest
    samples: int | None = Field(default=None, ge=0)
    format: Literal["packed", "webdataset"] | None = None
    offsets: list[int] | None = None
    #: every record of a packed shard has this many bytes (fixed-size samples): sample ``i``
    #: lies at ``16 + 8 (samples + 1) + i * record_size``, so a ranged read needs no offsets
    record_size: int | None = Field(default=None, ge=1)

    @field_validator("name")
    @classmethod
    def _valid_key(cls, v: str) -> str:
        return check_key(v)

    @model_validator(mode="after")
    def _offsets_fit(self) -> "ShardEntry":
        if self.offsets is not None:
            if self.samples is None or len(self.offsets) != self.samples + 1:
                raise ValueError(f"shard {self.name}: offsets must hold samples + 1 entries")
            if any(b < a for a, b in zip(self.offsets, self.offsets[1:])) or (
                self.offsets and (self.offsets[0] < 0 or self.offsets[-1] > self.size)
            ):
                raise ValueError(f"shard {self.name}: offsets must be ascending within the shard")
        if self.record_size is not None:
            if self.format != "packed" or self.samples is None or \
                    self.size != shard_overhead(self.samples) + self.samples * self.record_size:
                raise ValueError(f"shard {self.name}: record_size {self.record_size} does not fit a packed shard "
                                 f"of {self.samples} samples and {self.size} bytes")
        return self


class DatasetIndex(BaseModel):
    """The parsed index. Shard names are unique."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal[1] = 1
    shards: list[ShardEntry]

    @field_validator("shards")
    @classmethod
    def _unique(cls, v: list[ShardEntry]) -> list[ShardEntry]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError("duplicate shard names")
        return v


def parse_index(raw: bytes, where: str) -> DatasetIndex:
    """The index in ``raw``; ShardCorrupt naming ``where`` and the first problem otherwise."""
    try:
        return DatasetIndex.model_validate_json(raw)
    except ValidationError as exc:
        raise ShardCorrupt(f"{where}: invalid dataset index: {first_error(exc, root='').lstrip(': ')}") from exc


def shard_key(index_key: str, name: str) -> str:
    """The store key of shard ``name`` of the index at ``index_key``."""
    return _shard_key(index_key, name)


def file_digest(path: Path) -> tuple[int, str]:
    """``(size, sha256 hex)`` of a local file, read in chunks; StorageError (translated) when
    it cannot be read."""
    sha = hashlib.sha256()
    size = 0
    with translated(f"read {path}"), open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def _shard_key(index_key: str, name: str) -> str:
    base = posixpath.dirname(index_key)
    return f"{base}/{name}" if base else name


def build_index(store: ObjectStore, names: list[str], *, index_key: str = INDEX) -> DatasetIndex:
    """Hash the shards ``names`` (relative to the index's directory) and write the index
    atomically. Raises ObjectNotFound for a missing shard (no index written)."""
    entries = []
    for name in names:
        data = store.get_bytes(_shard_key(index_key, name))
        entries.append(ShardEntry(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
    index = DatasetIndex(shards=entries)
    store.put_bytes(index_key, index.model_dump_json(indent=2).encode())
    return index


def _check(data_size: int, digest: str, entry: ShardEntry, where: str) -> None:
    if data_size != entry.size:
        raise ShardCorrupt(f"{where}: size {data_size} bytes, index says {entry.size}")
    if digest != entry.sha256:
        raise ShardCorrupt(f"{where}: sha256 {digest[:12]}... does not match index {entry.sha256[:12]}...")


class ShardReader:
    """Local, verified access to the shards of one dataset index."""

    def __init__(self, store: ObjectStore, cache_dir: str | Path, *, index_key: str = INDEX) -> None:
        """Read and parse the index now. Raises ObjectNotFound when it is missing,
        ShardCorrupt when it is malformed, StorageError when the store fails."""
        self.store = store
        self.index_key = check_key(index_key)
        raw = store.get_bytes(index_key)
        self.index = parse_index(raw, f"{store.uri}/{index_key}")
        self._entries = {s.name: s for s in self.index.shards}
        self._cache = LocalStore(cache_dir)
        self._verified_local: set[str] = set()
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.index.shards]

    def path(self, name: str) -> Path:
        """A local path holding the verified content of shard ``name``. ``KeyError`` for a
        name not in the index; ShardCorrupt / StorageError as described in the module."""
        entry = self._entries[name]
        key = _shard_key(self.index_key, name)
        local = self.store.local_path(key)
        if local is not None:
            return self._verified_in_place(local, entry)
        cache_name = entry.sha256 + PurePosixPath(name).suffix
        cached = self._cache.root / check_key(cache_name)
        with translated(f"stat {cached}"):
            if cached.is_file() and cached.stat().st_size == entry.size:
                return cached
        data = self.store.get_bytes(key)
        _check(len(data), hashlib.sha256(data).hexdigest(), entry, f"{self.store.uri}/{key}")
        self._cache.put_bytes(cache_name, data)
        return cached

    def read(self, name: str) -> bytes:
        """The verified bytes of shard ``name``."""
        path = self.path(name)
        with translated(f"read {path}"):
            return path.read_bytes()

    def _verified_in_place(self, path: Path, entry: ShardEntry) -> Path:
        with self._lock:
            if entry.name in self._verified_local:
                return path
        size, digest = file_digest(path)
        _check(size, digest, entry, str(path))
        with self._lock:
            self._verified_local.add(entry.name)
        return path
