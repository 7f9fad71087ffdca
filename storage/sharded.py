"""Sharded checkpoints: every member of one replica group writes its own shards, and a load
reshards through ``torch.distributed.checkpoint`` (DCP).

Layout of a sharded checkpoint's directory (``Manifest.shards`` = S):

    shard-K-of-S.bin        member K's tensor chunks, raw bytes back to back (no pickle)
    shard-K-of-S.json       its index: for each tensor (a flattened state-dict key) the dtype,
                            the global size, and per chunk its offsets in the global tensor,
                            its sizes and where its bytes lie in the .bin (strict JSON)
    optimizer-groups.pt     the optimizer's non-tensor values (learning rates, betas, ...)
    scheduler.pt, rng.pt    as in a full checkpoint (``torch.save``, weights-only loadable)
    manifest.json           every file above with size and sha256, written last by member 0

Writing needs no collective: each member writes its pair of files from its own CPU snapshot
(a background thread, training goes on); member 0 writes the replicated files, waits for the
others' indexes to appear, then writes the manifest and moves LATEST (the rules of
:mod:`shoal.storage.checkpoint`). A member that never writes its part (it died) makes member
0's save fail after ``parts_timeout_s``: LATEST does not move.

Reading: DCP's load planner (``dcp.load(..., no_dist=True)``) works out, for the tensors of
the *loading* layout (any shard size, or whole tensors), which stored chunks overlap them;
:class:`ShardReader` serves those reads, fetching each .bin once and only after its size and
sha256 match the manifest. A data-parallel checkpoint is read the same way through
:class:`WholeTensorReader` (every tensor one chunk). DCP's own metadata file is a pickle; it
is never written nor read here: the indexes above are its JSON equivalent.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.events.validation import first_error
from shoal.storage.backend import ObjectStore
from shoal.storage.errors import CheckpointCorrupt, ObjectNotFound, StorageError
from shoal.storage.layout import SHARDED_FILES, file_key, shard_names
from shoal.storage.manifest import FileEntry, Manifest
from shoal.storage.resume_point import ResumePoint
from shoal.storage.verify import read_verified_file

#: the dtypes a shard file may hold (the name in the index -> torch dtype)
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
DTypeName = Literal["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]

class ChunkEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    offsets: list[int]
    sizes: list[int]
    #: where the chunk's bytes lie in the shard's .bin
    offset: int = Field(ge=0)
    length: int = Field(ge=0)


class TensorEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dtype: DTypeName
    size: list[int]
    chunks: list[ChunkEntry]


class ShardIndex(BaseModel):
    """``shard-K-of-S.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal[1] = 1
    step: int = Field(ge=0)
    shard: int = Field(ge=0)
    shard_size: int = Field(ge=1)
    data: FileEntry
    tensors: dict[str, TensorEntry]

    @classmethod
    def parse(cls, raw: bytes, where: str) -> "ShardIndex":
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise CheckpointCorrupt(f"{where}: invalid shard index at {first_error(exc)}") from exc


@dataclass
class Chunk:
    """One tensor's piece held by this member: ``tensor`` (its local values) sits at
    ``offsets`` in a global tensor of ``size``."""

    key: str
    tensor: torch.Tensor
    offsets: tuple[int, ...]
    size: tuple[int, ...]


@dataclass
class ShardedTrainState(ResumePoint):
    """What one member of the saving replica group writes: its chunks, and (member 0 only)
    the replicated values; the counters of its :class:`~shoal.storage.resume_point.ResumePoint`."""

    shard: int
    shard_size: int
    chunks: list[Chunk]
    optimizer_groups: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None

    def snapshot(self, reuse: "ShardedTrainState | None" = None) -> "ShardedTrainState":
        """A copy whose tensors are in CPU memory of their own (``reuse``'s buffers where
        the shapes match: see :func:`~shoal.storage.train_state.cpu_copy`)."""
        from shoal.storage.train_state import cpu_copy

        old = [c.tensor for c in reuse.chunks] if reuse is not None and len(reuse.chunks) == len(self.chunks) else None
        tensors = cpu_copy([c.tensor for c in self.chunks], old)
        return replace(
            self,
            chunks=[replace(c, tensor=t) for c, t in zip(self.chunks, tensors, strict=True)],
            optimizer_groups=cpu_copy(self.optimizer_groups),
            scheduler=cpu_copy(self.scheduler),
            rng=cpu_copy(self.rng),
            data_cursor=json.loads(json.dumps(self.data_cursor)),
        )

    def manifest_fields(self) -> dict[str, Any]:
        return {**super().manifest_fields(), "shards": self.shard_size}

    def components(self) -> dict[str, Any]:
        """Replicated file name -> object (member 0 writes them)."""
        parts = {"optimizer_groups": self.optimizer_groups, "scheduler": self.scheduler, "rng": self.rng}
        return {SHARDED_FILES[k]: v for k, v in parts.items() if v is not None}


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard(store: ObjectStore, state: ShardedTrainState, writer_factory: Callable) -> None:
    """Write this member's .bin (raw chunk bytes, hashed while written) then its .json."""
    data_name, index_name = shard_names(state.shard, state.shard_size)
    tensors: dict[str, dict[str, Any]] = {}
    with store.open_write(file_key(state.step, data_name)) as f:
        w = writer_factory(f)
        at = 0
        for c in state.chunks:
            dtype = _NAMES.get(c.tensor.dtype)
            if dtype is None:
                raise ValueError(f"{c.key}: dtype {c.tensor.dtype} cannot go into a sharded checkpoint")
            entry = tensors.setdefault(c.key, {"dtype": dtype, "size": list(c.size), "chunks": []})
            if entry["dtype"] != dtype or entry["size"] != list(c.size):
                raise ValueError(f"{c.key}: chunks of one tensor disagree on dtype or size")
            raw = _raw(c.tensor)
            w.write(raw)
            entry["chunks"].append({"offsets": list(c.offsets), "sizes": list(c.tensor.shape), "offset": at,
                                    "length": raw.nbytes})
            at += raw.nbytes
    index = ShardIndex(step=state.step, shard=state.shard, shard_size=state.shard_size, data=w.entry(),
                       tensors={k: TensorEntry.model_validate(v) for k, v in tensors.items()})
    store.put_bytes(file_key(state.step, index_name), index.model_dump_json().encode())


def wait_for_shards(store: ObjectStore, step: int, shard_size: int, timeout_s: float) -> dict[str, FileEntry]:
    """The entries (size, sha256) of every member's .bin and .json once all indexes of
    ``step`` are in the store; CheckpointCorrupt after ``timeout_s`` naming the missing."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    found: dict[str, FileEntry] = {}
    missing = list(range(shard_size))
    while True:
        for k in list(missing):
            data_name, index_name = shard_names(k, shard_size)
            try:
                raw = store.get_bytes(file_key(step, index_name))
            except ObjectNotFound:
                continue
            index = ShardIndex.parse(raw, f"{store.uri}/{file_key(step, index_name)}")
            if index.step != step or index.shard != k or index.shard_size != shard_size:
                continue  # an older attempt's index: wait for this one's
            found[index_name] = FileEntry(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
            found[data_name] = index.data
            missing.remove(k)
        if not missing:
            return found
        if time.monotonic() >= deadline:
            names = ", ".join(shard_names(k, shard_size)[1] for k in missing)
            raise CheckpointCorrupt(f"{store.uri}/{file_key(step, '')}: {names} not written within {timeout_s:.0f} s "
                                    f"(a member of the saving replica group did not finish its part)")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


# --- reading through DCP -------------------------------------------------------------------------
def _verified(store: ObjectStore, manifest: Manifest, name: str) -> bytes:
    return read_verified_file(store, manifest, name)


def read_indexes(store: ObjectStore, manifest: Manifest) -> list[ShardIndex]:
    """Every member's index of a sharded checkpoint (verified against the manifest)."""
    shard_size = manifest.shards or 1
    out = []
    for k in range(shard_size):
        _data, index_name = shard_names(k, shard_size)
        where = f"{store.uri}/{file_key(manifest.step, index_name)}"
        index = ShardIndex.parse(_verified(store, manifest, index_name), where)
        if index.step != manifest.step or index.shard != k or index.shard_size != shard_size:
            raise CheckpointCorrupt(f"{where}: index says step {index.step}, shard {index.shard} of "
                                    f"{index.shard_size}")
        out.append(index)
    return out


@dataclass(frozen=True)
class _Where:
    """Where a stored chunk's bytes are: a file (None: an in-memory whole tensor) and range."""

    file: str | None
    offset: int
    length: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    #: the whole tensor itself, for :class:`WholeTensorReader`
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint import planner

    return dcp, md, planner


class _ChunkReader:
    """DCP ``StorageReader`` over chunks described by :class:`_Where` records. Subclasses
    give the metadata and the bytes of a file."""

    def __init__(self) -> None:
        _dcp_mod, md, _planner = _dcp()
        self._md = md
        self.sizes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.where: dict[Any, _Where] = {}

    # the StorageReader protocol (DCP calls these; see torch.distributed.checkpoint.storage)
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any):
        md = self._md
        chunks: dict[str, list] = {key: [] for key in self.sizes}
        for idx, w in self.where.items():
            chunks[idx.fqn].append(md.ChunkStorageMetadata(offsets=torch.Size(idx.offset), sizes=torch.Size(w.sizes)))
        tensors = {key: md.TensorStorageMetadata(properties=md.TensorProperties(dtype=dtype), size=torch.Size(size),
                                                 chunks=chunks[key])
                   for key, (dtype, size) in self.sizes.items()}
        return md.Metadata(state_dict_metadata=tensors, storage_data=dict(self.where))

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _tensor(self, w: _Where) -> torch.Tensor:
        raise NotImplementedError

    def read_data(self, plan, planner):
        from torch.futures import Future

        for req in plan.items:
            w = self.where[req.storage_index]
            stored = self._tensor(w)
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                stored = stored.narrow(dim, start, length)
            target = planner.resolve_tensor(req).detach()
            if target.size() != stored.size():
                raise CheckpointCorrupt(f"{req.storage_index.fqn}: a read of {tuple(stored.size())} for a target "
                                        f"of {tuple(target.size())}")
            target.copy_(stored)
            planner.commit_tensor(req, target)
        done: Future = Future()
        done.set_result(None)
        return done


class ShardReader(_ChunkReader):
    """The chunks of a sharded checkpoint; a .bin is fetched (and verified) when the load
    plan first needs it, and only then."""

    def __init__(self, store: ObjectStore, manifest: Manifest, indexes: list[ShardIndex]) -> None:
        super().__init__()
        self._store = store
        self._manifest = manifest
        self._files: dict[str, bytearray] = {}
        for index in indexes:
            data_name, _ = shard_names(index.shard, index.shard_size)
            for key, entry in index.tensors.items():
                dtype, size = DTYPES[entry.dtype], tuple(entry.size)
                if self.sizes.setdefault(key, (dtype, size)) != (dtype, size):
                    raise CheckpointCorrupt(f"{store.uri}/{file_key(manifest.step, data_name)}: {key} is "
                                            f"{entry.dtype} {size} here and {self.sizes[key]} in another shard")
                for c in entry.chunks:
                    if any(s == 0 for s in c.sizes):
                        continue
                    itemsize = torch.empty((), dtype=dtype).element_size()
                    if c.length != itemsize * _numel(c.sizes) or len(c.offsets) != len(size):
                        raise CheckpointCorrupt(f"{store.uri}/{file_key(manifest.step, data_name)}: {key} has a "
                                                f"chunk whose length does not match its sizes")
                    index_key = self._md.MetadataIndex(fqn=key, offset=torch.Size(c.offsets))
                    self.where[index_key] = _Where(data_name, c.offset, c.length, dtype, tuple(c.sizes))

    def _tensor(self, w: _Where) -> torch.Tensor:
        blob = self._files.get(w.file)
        if blob is None:
            blob = self._files[w.file] = bytearray(_verified(self._store, self._manifest, w.file))
        if w.offset + w.length > len(blob):
            raise CheckpointCorrupt(f"{self._store.uri}/{file_key(self._manifest.step, w.file)}: a chunk lies "
                                    f"beyond the end of the file")
        raw = torch.frombuffer(blob, dtype=torch.uint8, count=w.length, offset=w.offset) if w.length else \
            torch.empty(0, dtype=torch.uint8)
        return raw.view(w.dtype).reshape(w.sizes)


class WholeTensorReader(_ChunkReader):
    """Whole tensors held in memory (a data-parallel checkpoint's, flattened) as a
    one-chunk-per-tensor checkpoint: loads them into any sharded layout."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for key, t in tensors.items():
            self.sizes[key] = (t.dtype, tuple(t.shape))
            index_key = self._md.MetadataIndex(fqn=key, offset=torch.Size([0] * t.dim()))
            self.where[index_key] = _Where(None, 0, 0, t.dtype, tuple(t.shape), tensor=t)

    def _tensor(self, w: _Where) -> torch.Tensor:
        return w.tensor


def _numel(sizes: list[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def load_into(tensors: dict[str, torch.Tensor], reader: _ChunkReader) -> None:
    """Fill ``tensors`` (plain tensors or DTensors: this process's part of each) from
    ``reader``'s chunks, resharding as needed (DCP's load planner, no collective). A key the
    checkpoint lacks raises CheckpointCorrupt naming it."""
    dcp, _md, _planner = _dcp()
    missing = sorted(set(tensors) - set(reader.sizes))
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointCorrupt(f"the checkpoint has no {', '.join(missing[:3])}{more} (another model?)")
    for key, t in tensors.items():
        dtype, size = reader.sizes[key]
        if tuple(t.shape) != size:
            raise CheckpointCorrupt(f"{key}: the checkpoint holds {tuple(size)}, the model {tuple(t.shape)}")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        except dcp.api.CheckpointException as exc:  # DCP wraps what the reader raised: unwrap it
            for failure in exc.failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, StorageError):
                    raise inner from None
            raise CheckpointCorrupt(f"loading the checkpoint's tensors failed: {str(exc).strip().splitlines()[-1]}") \
                from exc


@dataclass
class ShardedCheckpoint(ResumePoint):
    """A sharded checkpoint opened for loading: the counters (its
    :class:`~shoal.storage.resume_point.ResumePoint`) and replicated values read and
    verified; :attr:`reader` serves the tensors to :func:`load_into` (any layout)."""

    shards: int
    reader: ShardReader
    optimizer_groups: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] | None = None


def open_sharded(store: ObjectStore, manifest: Manifest) -> ShardedCheckpoint:
    """Open the sharded checkpoint ``manifest`` describes (verifying every file it reads)."""
    from shoal.storage.safe_load import load_state_bytes

    reader = ShardReader(store, manifest, read_indexes(store, manifest))
    parts: dict[str, Any] = {}
    for component, name in SHARDED_FILES.items():
        if name in manifest.files:
            where = f"{store.uri}/{file_key(manifest.step, name)}"
            parts[component] = load_state_bytes(_verified(store, manifest, name), where=where)
    return ShardedCheckpoint(shards=manifest.shards or 1, reader=reader, **ResumePoint.counters(manifest), **parts)
