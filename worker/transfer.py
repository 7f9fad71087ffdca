"""State transfer between the members of a generation: a model, its optimizer and LR
scheduler, and a small JSON-able ``extra`` (step, cursor), from one rank to others. No pickle.

:func:`catch_up_state`
    What a generation switch uses, first thing in every new generation: every rank passes its
    number of committed steps; the most advanced member (lowest rank on ties) sends its state
    point to point to the members that are behind only, and does not wait for the transfer.
:func:`broadcast_state`
    A collective: every rank gets ``src``'s state. :func:`resync_state` picks ``src`` the way
    :func:`catch_up_state` does and broadcasts to every other rank, behind or not.

Encoding
    A JSON header describes the structure of ``model.state_dict()``, ``optimizer.state_dict()``,
    the scheduler's state and ``extra``, with every tensor replaced by a reference (tuples and
    non-string dict keys are tagged so they survive the round trip). The tensors follow packed
    into flat buffers of one dtype (broadcast) or as one message each (catch-up); a tensor
    over :data:`CHUNK_BYTES` goes in pieces that are views of it, received in place. A
    receiver whose model or optimizer differs in structure raises
    :class:`~shoal.worker.errors.StateMismatch` before anything is changed; a failed peer
    surfaces as :class:`~shoal.worker.errors.CollectiveFailed`. Receivers copy weights and
    buffers in place (the optimizer's parameter references stay valid) and load optimizer and
    scheduler state with ``load_state_dict``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shoal.worker import process_group as pg
from shoal.worker import torch_compat as tc
from shoal.worker.errors import StateMismatch

_T = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """JSON-able form of ``obj`` with tensors replaced by references into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(tc.local(obj.detach()))  # a sharded (HSDP) tensor: this member's shard
        return {_T: len(tensors) - 1}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(o, tensors) for o in obj]}
    if isinstance(obj, list):
        return [_encode(o, tensors) for o in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k not in (_T, _TUPLE, _DICT) for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {_DICT: [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(f"cannot send a {type(obj).__name__} in a state broadcast (JSON types and tensors only)")


def _decode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(o, tensors) for o in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and _T in obj:
            return tensors[obj[_T]]
        if len(obj) == 1 and _TUPLE in obj:
            return tuple(_decode(o, tensors) for o in obj[_TUPLE])
        if len(obj) == 1 and _DICT in obj:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in obj[_DICT]}
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


#: A joiner's state transfer is bounded by ``TRANSFER_BASE_S`` plus its size at
#: ``TRANSFER_MIN_RATE`` bytes/s: a big model gets the time it needs, a stalled transfer
#: fails (and the group is aborted) instead of hanging the generation.
TRANSFER_BASE_S = 30.0
TRANSFER_MIN_RATE = 20e6
#: A tensor larger than this goes as several messages, each a view of it (no copy): gloo's
#: and the wire's 2 GiB limits never apply, and a multi-GB parameter needs no second buffer.
CHUNK_BYTES = 128 * 2**20


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` (contiguous) as views of at most :data:`CHUNK_BYTES` each, the same split on the
    sending and the receiving side."""
    if t.numel() * t.element_size() <= CHUNK_BYTES:
        return [t]
    return list(t.reshape(-1).split(max(1, CHUNK_BYTES // t.element_size())))


def transfer_timeout(nbytes: int) -> float:
    """How long a state transfer of ``nbytes`` may take."""
    return TRANSFER_BASE_S + nbytes / TRANSFER_MIN_RATE


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the model's and the optimizer's tensors here (what a catch-up moves; an HSDP
    member's shards)."""
    tensors = list(model.state_dict().values())
    for st in optimizer.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(tc.local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise StateMismatch(f"unknown dtype {name!r} in a state broadcast")
    return dt


def _structure(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": [[k, str(v.dtype), list(tc.local(v).shape)] for k, v in model.state_dict().items()],
        "groups": [len(g["params"]) for g in optimizer.param_groups],
    }


def _members(group: pg.Group | None) -> tuple[pg.Group | None, int, int, torch.device]:
    """The group a transfer runs over (None: a one-process run, nothing to move), this rank,
    its size and the device tensors go through."""
    g = group
    if g is None:
        return None, 0, 1, torch.device("cpu")
    return g, g.rank, g.world_size, g.device


def broadcast_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    src: int,
    *,
    lr_scheduler: Any | None = None,
    group: pg.Group | None,
) -> dict[str, Any]:
    """Make every rank's model, optimizer (and LR scheduler) state equal to rank ``src``'s.

    Collective: every rank of ``group`` calls it with the same ``src``. On ``src``,
    ``extra`` is a dict of JSON types and tensors (step, cursor, ...) sent along; on the others
    it is ignored. Returns ``src``'s ``extra`` on every rank. Model parameters and buffers are
    overwritten in place (the optimizer's references stay valid); optimizer and scheduler
    state are replaced with ``load_state_dict``.

    Raises StateMismatch on every rank when some receiver's model or optimizer differs in
    structure from ``src``'s (names, dtypes, shapes, parameter groups) or ``src``'s state
    cannot be encoded (nothing is changed anywhere); CollectiveFailed when a peer fails.
    """
    g, rank, world, comm = _members(group)
    if world == 1:
        return dict(extra or {})

    # 1. header: JSON structure + references to tensors
    tensors: list[torch.Tensor] = []
    payload = b""
    error = ""
    if rank == src:
        try:
            header = {
                "structure": _structure(model, optimizer),
                "model": _encode(dict(model.state_dict()), tensors),
                "optimizer": _encode(optimizer.state_dict(), tensors),
                "scheduler": _encode(lr_scheduler.state_dict(), tensors) if lr_scheduler is not None else None,
                "extra": _encode(dict(extra or {}), tensors),
            }
            header["tensors"] = [[str(t.dtype), list(t.shape), t.device.type] for t in tensors]
            payload = json.dumps(header, allow_nan=True).encode()
        except (TypeError, ValueError) as exc:
            error = f"rank {src} cannot encode its state: {exc}"
            payload = b""
    size = torch.tensor([len(payload) if not error else -1], dtype=torch.int64, device=comm)
    g.broadcast(size, src)
    if int(size) < 0:
        raise StateMismatch(error or f"rank {src} could not encode its state")
    buf = torch.zeros(int(size), dtype=torch.uint8, device=comm)
    if rank == src:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    g.broadcast(buf, src)
    header = json.loads(bytes(buf.cpu().numpy().tobytes()).decode())

    # 2. every rank checks it can take the state; all agree before any tensor moves
    mine = _structure(model, optimizer)
    problem = "" if mine == header["structure"] else _describe_mismatch(mine, header["structure"])
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64, device=comm)
    g.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag):
        raise StateMismatch(
            f"state broadcast from rank {src} refused: " + (problem or "another rank's model differs")
        )

    # 3. tensors: packed into flat buffers, or (large ones) in pieces of their own
    specs = header["tensors"]
    if rank != src:  # shapes and dtypes only: no memory until received
        tensors = [torch.empty(shape, dtype=_dtype(dt), device="meta") for dt, shape, _ in specs]
    received = _broadcast_tensors(g, tensors, src, comm, rank)

    if rank != src:
        local_dev = comm
        placed = [
            t.to(local_dev if devtype != "cpu" else torch.device("cpu"))
            for t, (_, _, devtype) in zip(received, specs)
        ]
        return _load_received(model, optimizer, lr_scheduler, header, placed)
    return _decode(header["extra"], tensors)


def _describe_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    if mine["groups"] != theirs["groups"]:
        return f"optimizer parameter groups differ: {mine['groups']} here vs {theirs['groups']}"
    a = {k: (d, s) for k, d, s in mine["model"]}
    b = {k: (d, s) for k, d, s in theirs["model"]}
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            return f"model entry {k!r}: {a.get(k)} here vs {b.get(k)} at the source"
    return "model state order differs"


def _broadcast_tensors(
    g: pg.Group, tensors: list[torch.Tensor], src: int, comm: torch.device, rank: int
) -> list[torch.Tensor]:
    """Broadcast ``tensors`` (filled on ``src``, correctly shaped everywhere); returns the
    received tensors (on CPU unless ``comm`` is a GPU). A tensor over :data:`CHUNK_BYTES` goes
    on its own, in pieces that are views of it (no copy on ``src``; received in place); the
    others go packed into flat buffers of at most that size, one dtype each, so no more than
    one buffer is held at a time."""
    out: list[torch.Tensor] = list(tensors)
    buckets: list[list[int]] = []
    open_bucket: dict[torch.dtype, tuple[list[int], int]] = {}  # dtype -> (indices, bytes)
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            continue
        nbytes = t.numel() * t.element_size()
        wire = _wire(t.dtype)
        if nbytes > CHUNK_BYTES:
            big = t.to(comm, wire).contiguous() if rank == src else torch.empty(t.shape, dtype=wire, device=comm)
            for piece in _pieces(big):
                g.broadcast(piece, src)
            out[i] = big if rank == src else big.to(t.dtype)
            continue
        bucket, filled = open_bucket.get(t.dtype, (None, 0))
        if bucket is None or filled + nbytes > CHUNK_BYTES:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(i)
        open_bucket[t.dtype] = (bucket, filled + nbytes)
    for idxs in buckets:
        dtype = tensors[idxs[0]].dtype
        wire = _wire(dtype)
        total = sum(tensors[i].numel() for i in idxs)
        if rank == src:
            flat = torch.cat([tensors[i].reshape(-1).to(comm, wire) for i in idxs])
        else:
            flat = torch.empty(total, dtype=wire, device=comm)
        g.broadcast(flat, src)
        offset = 0
        for i in idxs:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].reshape(tensors[i].shape).to(dtype).clone()
            offset += n
    return out


def resync_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    committed_step: int,
    *,
    lr_scheduler: Any | None = None,
    group: pg.Group | None,
) -> tuple[int, dict[str, Any]]:
    """Start a generation from the most advanced member's state. Collective over ``group``.

    Every rank passes the number of steps it has committed (``-1`` for a fresh joiner with no
    state; workers that built the initial model from the seed pass ``0``); the rank with the
    highest count (lowest rank on ties) broadcasts its model,
    optimizer, scheduler and ``extra`` (which should hold at least the step and the cursor) to
    all others with :func:`broadcast_state`. Returns ``(src, extra of src)``: every rank then
    continues from ``extra``'s step and cursor. Errors as :func:`broadcast_state`.
    """
    g, rank, world, comm = _members(group)
    if committed_step < -1:
        raise ValueError(f"committed_step must be >= -1, got {committed_step}")
    if world == 1:
        return 0, dict(extra or {})
    # encode (steps, lowest rank) in one MAX: larger step wins, then the smaller rank
    key = torch.tensor([(committed_step + 1) * world + (world - 1 - rank)], dtype=torch.int64, device=comm)
    g.all_reduce(key, dist.ReduceOp.MAX)
    src = world - 1 - int(key) % world
    return src, broadcast_state(model, optimizer, extra, src, lr_scheduler=lr_scheduler, group=group)


def _fingerprint(structure: dict[str, Any]) -> int:
    """A signed 64-bit hash of :func:`_structure`'s result (equal structures, equal numbers)."""
    return int.from_bytes(hashlib.sha256(json.dumps(structure).encode()).digest()[:8], "big", signed=True)


def _wire(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


def catch_up_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, Any] | None,
    committed_step: int,
    *,
    lr_scheduler: Any | None = None,
    group: pg.Group | None,
    on_header_sent: Callable[[], None] | None = None,
) -> tuple[int, dict[str, Any], list[int]]:
    """Start a generation from the most advanced member's state, moving it only where needed.

    Collective: every rank of ``group`` calls it first thing in a generation with its
    number of committed steps (``-1``: a joiner with no state). One 16-byte-per-rank SUM
    all-reduce gathers every rank's step count and a fingerprint of its model/optimizer
    structure; every rank derives the same plan from it:

    * ``src``: the lowest rank with the most committed steps; ``behind``: the ranks with fewer;
    * nobody behind (the usual case after a failure or a leave): nothing moves;
    * structures differ: :func:`broadcast_state` runs, which raises StateMismatch on every rank
      (naming the difference) before any tensor moves;
    * otherwise ``src`` posts its state point to point to each rank behind (the
      :func:`broadcast_state` header, then each tensor as a message; weights and optimizer
      state without a copy) and returns at once (:func:`shoal.worker.process_group.isend`; the
      next all-reduce reaps the sends); each rank behind receives everything, then loads
      it, before returning. The other ranks take no part - their state equals ``src``'s -
      and go on to their next step, whose all-reduce waits for the ranks behind.

    ``group`` (default: the current generation's) is the group it runs over: an HSDP cross
    group moves each member's own shards between the replica groups' members of one shard
    index (sharded tensors go as their local shards and are loaded back into them).

    ``on_header_sent`` (fault injection: the ``transfer`` phase) is called on ``src`` once the
    ranks behind have its header and before any tensor is posted to them.

    Returns ``(src, extra, behind)``: ``extra`` is ``src``'s (received on the ranks behind,
    the caller's own elsewhere). Raises StateMismatch as above (or on ``src`` and the ranks
    behind when ``src`` cannot encode its state), CollectiveFailed when a peer fails.
    """
    g, rank, world, comm = _members(group)
    if committed_step < -1:
        raise ValueError(f"committed_step must be >= -1, got {committed_step}")
    if world == 1:
        return 0, dict(extra or {}), []
    mine = _structure(model, optimizer)
    table = torch.zeros(world, 2, dtype=torch.int64, device=comm)
    table[rank, 0] = committed_step
    table[rank, 1] = _fingerprint(mine)
    g.all_reduce(table, dist.ReduceOp.SUM)
    steps = [int(v) for v in table[:, 0].tolist()]
    fingerprints = set(table[:, 1].tolist())
    top = max(steps)
    src = steps.index(top)
    if len(fingerprints) > 1:
        return src, broadcast_state(model, optimizer, extra, src, lr_scheduler=lr_scheduler, group=g), \
            [r for r in range(world) if r != src]
    behind = [r for r, s in enumerate(steps) if s < top]
    if rank == src and behind:
        _send_state(g, model, optimizer, extra, lr_scheduler, behind, comm, on_header_sent)
    elif rank in behind:
        return src, _recv_state(g, model, optimizer, lr_scheduler, src, mine, comm), behind
    return src, dict(extra or {}), behind


def _send_state(g: pg.Group, model, optimizer, extra, lr_scheduler, dsts: list[int], comm: torch.device,
                on_header_sent: Callable[[], None] | None = None) -> None:
    """Post ``src``'s state to ``dsts``: the header length, the header, then every tensor as its
    own message. Parameters and optimizer state go as they are (no copy): they change only in
    ``optimizer.step``, i.e. after the next all-reduce, which cannot complete before every
    receiver has taken all of them. Everything else (buffers, which a forward pass updates;
    scheduler state; extra) is copied first."""
    tensors: list[torch.Tensor] = []
    error = ""
    try:
        header = {"structure": _structure(model, optimizer), "model": _encode(dict(model.state_dict()), tensors)}
        params = {(tc.local(p).data_ptr(), tc.local(p).numel()) for p in model.parameters()}
        stable = [(t.data_ptr(), t.numel()) in params for t in tensors]  # weights, not buffers
        header["optimizer"] = _encode(optimizer.state_dict(), tensors)
        stable += [True] * (len(tensors) - len(stable))
        header["scheduler"] = _encode(lr_scheduler.state_dict(), tensors) if lr_scheduler is not None else None
        header["extra"] = _encode(dict(extra or {}), tensors)
        stable += [False] * (len(tensors) - len(stable))
        header["tensors"] = [[str(t.dtype), list(t.shape), t.device.type] for t in tensors]
        payload = json.dumps(header, allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        error = f"rank {g.rank} cannot encode its state: {exc}"
        payload = b""
    size = torch.tensor([-1 if error else len(payload)], dtype=torch.int64, device=comm)
    wire: list[torch.Tensor] = []
    if not error:
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(comm)
        for t, keep in zip(tensors, stable):
            if t.numel() == 0:
                continue
            w = t.to(comm, _wire(t.dtype)).contiguous()
            wire.append(w if keep or w.data_ptr() != t.data_ptr() else w.clone())
    # posted, not waited for (the caller goes on training at once); the next all-reduce reaps
    # the sends, since each receiver takes everything before it joins that all-reduce
    for dst in dsts:
        g.isend(size, dst)
        if not error:
            g.isend(buf, dst)
    if on_header_sent is not None and not error:
        g.wait_sends()  # the header has arrived: what the hook does lands mid-transfer
        on_header_sent()
    for dst in dsts:
        if error:
            continue
        for w in wire:
            for piece in _pieces(w):
                g.isend(piece, dst)
    if error:
        g.wait_sends()  # the receivers got the -1 and raise too
        raise StateMismatch(error)


def _recv_state(g: pg.Group, model, optimizer, lr_scheduler, src: int, mine: dict[str, Any],
                comm: torch.device) -> dict[str, Any]:
    """Receive what :func:`_send_state` posts into fresh tensors, then load it (nothing is
    changed before everything has arrived)."""
    size = torch.zeros(1, dtype=torch.int64, device=comm)
    g.recv(size, src)
    if int(size) < 0:
        raise StateMismatch(f"rank {src} could not encode its state")
    buf = torch.empty(int(size), dtype=torch.uint8, device=comm)
    g.recv(buf, src)
    header = json.loads(bytes(buf.cpu().numpy().tobytes()).decode())
    if header["structure"] != mine:  # the fingerprints matched: only a hash collision gets here
        raise StateMismatch(f"state from rank {src} refused: {_describe_mismatch(mine, header['structure'])}")
    specs = header["tensors"]
    wire = [torch.empty(shape, dtype=_wire(_dtype(dt)), device=comm) for dt, shape, _ in specs]
    nbytes = sum(w.numel() * w.element_size() for w in wire)
    # the whole transfer is bounded by its size-scaled timeout, and so is each piece: the
    # group's own timeout came from this member's state, which may be smaller (a joiner's
    # optimizer holds no state yet)
    bound = transfer_timeout(nbytes)
    g.extend_timeout(bound)
    g.recv_many([piece for w in wire if w.numel() for piece in _pieces(w)], src, timeout=bound)
    placed = [
        w.to(_dtype(dt)).to(comm if devtype != "cpu" else torch.device("cpu"))
        for w, (dt, _, devtype) in zip(wire, specs)
    ]
    return _load_received(model, optimizer, lr_scheduler, header, placed)


def _sharded_like_params(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """An optimizer state dict received as local shards, its per-parameter tensors shaped
    like a sharded (DTensor) parameter's shard made DTensors laid out like it (what the
    optimizer holds for a sharded parameter); unchanged for plain parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = state_dict.get("state", {})
    for index, entry in state.items():
        if isinstance(index, int) and 0 <= index < len(params) and isinstance(entry, dict):
            p = params[index]
            state[index] = {k: tc.like_param(p, v) if isinstance(v, torch.Tensor) and v.dim() else v
                            for k, v in entry.items()}
    return state_dict


def _load_received(model, optimizer, lr_scheduler, header: dict, placed: list) -> dict:
    """Copy a received state (header + tensors placed on this rank's devices) into the model
    in place (the optimizer's parameter references stay valid), the optimizer and the
    scheduler; returns the sender's ``extra``."""
    model_state = _decode(header["model"], placed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            tc.local(t).copy_(model_state[name])  # a sharded parameter: into its local shard
    optimizer.load_state_dict(_sharded_like_params(optimizer, _decode(header["optimizer"], placed)))
    if lr_scheduler is not None and header["scheduler"] is not None:
        lr_scheduler.load_state_dict(_decode(header["scheduler"], placed))
    return _decode(header["extra"], placed)
