"""DiLoCo's outer step as pure tensor functions: the outer gradient's wire formats and the
outer Nesterov SGD (used by :mod:`shoal.worker.layout_diloco`; tested on their own).

Wire formats of a member's outer gradient (``outer_dtype`` in the spec)
    ``fp32``: the values as they are (all-reduced, SUM). ``bf16``: each value rounded to
    bfloat16 (2 bytes). ``int8``: the values cut in blocks of ``block``; each block carries one
    fp32 scale (its largest magnitude / 127) and one int8 per value (``round(x / scale)``):
    ~1 + 4/block bytes a value. The compressed formats are all-gathered, not all-reduced:
    every member decodes every member's message and sums them **in fp32, in rank order**, so
    the sum is the same bits on every member (and no sum is ever formed in 8 or 16 bits).

Pieces on the wire
    A member's message crosses in pieces of :func:`piece_bytes` of the spec's collective
    timeout (one collective each, in order; the same cut on every member), so the collective
    timeout bounds one piece, not the exchange: an exchange that keeps moving bytes at
    :data:`FLOOR_RATE` or more is never timed out, however long it takes (a 150 MB outer
    gradient takes 2 minutes at 10 Mbit/s), while a peer that moves nothing (partitioned,
    hung) still fails it within the timeout. gloo's ring all-reduce
    already waits segment by segment (measured: a 40 MB fp32 all-reduce over a 10 Mbit/s link
    completed in 39 s under a 4 s timeout): it goes whole, as one collective
    (:func:`waits_by_segment`; pieces would only add a collective's latency each). gloo's
    all-gather waits for a member's whole message and an NCCL wait here is bounded whole
    (:meth:`Group._wait`): without pieces, a bf16 or int8 message longer than the timeout at the
    link's rate failed every round.

The outer optimizer
    :func:`nesterov_step` is ``torch.optim.SGD(lr, momentum, nesterov=True)`` (no dampening,
    no weight decay) on flat fp32 tensors, with the same operations in the same order, so its
    result is deterministic: equal inputs give equal bits on every member.
"""

from __future__ import annotations

import torch

#: the trailing fp32 values of a member's outer message: how far its newest seen generation is
#: ahead of the group's, its inner steps' loss sum, its sample count
TAIL = 3
#: the wire formats (``outer_dtype``)
DTYPES = ("fp32", "bf16", "int8")
#: The slowest link an outer exchange must survive, bytes/s (1 Mbit/s): a piece is what it
#: carries in one collective timeout, so only a link slower than this - or one moving nothing
#: - times a piece out.
FLOOR_RATE = 125_000
#: Bounds of a piece, bytes: small enough that a slow link moves one well within the timeout,
#: large enough that a fast link does not pay a collective's latency per few KB.
MIN_PIECE = 256 * 1024
MAX_PIECE = 16 * 2**20


def piece_bytes(timeout: float) -> int:
    """The bytes of one piece of an outer exchange over a group whose collective timeout is
    ``timeout`` s: what :data:`FLOOR_RATE` carries in it, within [MIN_PIECE, MAX_PIECE]."""
    if not timeout > 0:
        raise ValueError(f"a collective timeout must be positive, got {timeout!r}")
    return int(min(MAX_PIECE, max(MIN_PIECE, timeout * FLOOR_RATE)))


def waits_by_segment(backend: str, dtype: str) -> bool:
    """Whether an outer exchange of ``dtype`` over a ``backend`` group already waits piece by
    piece on its own, so it goes as one collective: gloo's ring all-reduce (fp32), whose
    timeout bounds each segment's transfer. Everything else - all-gathers (bf16, int8) and
    NCCL, whose wait is bounded whole - goes in pieces."""
    return backend == "gloo" and dtype == "fp32"


def spans(n: int, size: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut in consecutive ``(start, end)`` spans of at most ``size`` (n 0: none)."""
    if size < 1:
        raise ValueError(f"a span holds at least one element, got {size}")
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def nesterov_step(params: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, *, lr: float,
                  momentum: float) -> None:
    """One step of SGD with Nesterov momentum, in place on ``params`` and the momentum
    ``buf`` (a zero buffer is a first step: ``buf`` becomes ``grad``, as torch's does)."""
    buf.mul_(momentum).add_(grad)
    params.add_(grad.add(buf, alpha=momentum), alpha=-lr)


def encode(values: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """``values`` (flat fp32) in the wire format ``dtype`` as bytes (uint8)."""
    if dtype == "fp32":
        return values.contiguous().view(torch.uint8)
    if dtype == "bf16":
        return values.to(torch.bfloat16).view(torch.uint8)
    if dtype == "int8":
        n = values.numel()
        blocks = -(-n // block)
        padded = torch.zeros(blocks * block, dtype=torch.float32, device=values.device)
        padded[:n] = values
        padded = padded.view(blocks, block)
        scales = padded.abs().amax(dim=1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scales.contiguous().view(torch.uint8), q.view(-1).view(torch.uint8)])
    raise ValueError(f"outer_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def decode(wire: torch.Tensor, dtype: str, block: int, n: int) -> torch.Tensor:
    """The ``n`` fp32 values of an :func:`encode` message."""
    if dtype == "fp32":
        return wire.view(torch.float32)[:n]
    if dtype == "bf16":
        return wire.view(torch.bfloat16)[:n].float()
    if dtype == "int8":
        blocks = -(-n // block)
        scales = wire[: 4 * blocks].view(torch.float32)
        q = wire[4 * blocks:].view(torch.int8).view(blocks, block)
        return (q.float() * scales[:, None]).view(-1)[:n]
    raise ValueError(f"outer_dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def wire_bytes(n: int, dtype: str, block: int) -> int:
    """Bytes of one member's message of ``n`` values (without the tail)."""
    if dtype == "fp32":
        return 4 * n
    if dtype == "bf16":
        return 2 * n
    blocks = -(-n // block)
    return 4 * blocks + blocks * block


def pack(delta: torch.Tensor, tail: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """One member's message: the fp32 ``tail`` (:data:`TAIL` values, the sample count last)
    exactly, then its (unweighted) outer gradient ``delta`` in ``dtype`` (the tail first: the
    body's fp32 and bf16 views stay aligned)."""
    return torch.cat([tail.to(torch.float32).contiguous().view(torch.uint8), encode(delta, dtype, block)])


def combine(messages: list[torch.Tensor], dtype: str, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' :func:`pack` messages (rank order) -> (the sum of each member's outer
    gradient times its sample count, fp32, summed in rank order; the sum of the tails)."""
    total = torch.zeros(n, dtype=torch.float32, device=messages[0].device)
    tails = torch.zeros(TAIL, dtype=torch.float32, device=messages[0].device)
    head = 4 * TAIL
    for message in messages:
        tail = message[:head].view(torch.float32)
        count = float(tail[-1])
        if count:
            total.add_(decode(message[head:], dtype, block, n), alpha=count)
        tails.add_(tail)
    return total, tails


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``|approx - exact| / |exact|`` (L2)."""
    return float(torch.linalg.vector_norm(approx.double() - exact.double()) / torch.linalg.vector_norm(exact.double()))
