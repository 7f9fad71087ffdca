"""The one place where the training side reads meaning out of error *text*.

torch.distributed, gloo, NCCL and CUDA report most failures as ``RuntimeError`` (or
``DistBackendError``) whose only distinguishing mark is the message. Everything that decides
on such a message asks here, so the patterns live in one table each, with a test per class
(``tests/unit/test_classify.py``). Where a type exists it is used first
(``torch.OutOfMemoryError``, ``torch.distributed.DistStoreError``, shoal's own errors).
"""

from __future__ import annotations

from shoal.events.models import FormationError

#: Lower-case fragments of messages, first match wins, and the class they mean. Configuration
#: errors fail the same way at every try for the same members and settings.
FORMATION_PATTERNS: tuple[tuple[str, FormationError], ...] = (
    ("invalid usage", FormationError.NCCL_INVALID_USAGE),  # ncclInvalidUsage: e.g. two ranks on one GPU
    ("ncclinvalidusage", FormationError.NCCL_INVALID_USAGE),
    ("duplicate gpu detected", FormationError.NCCL_INVALID_USAGE),
    ("out of memory", FormationError.CUDA_OUT_OF_MEMORY),
    ("invalid device ordinal", FormationError.NO_DEVICE),
    ("no cuda gpus are available", FormationError.NO_DEVICE),
    ("found no nvidia driver", FormationError.NO_DEVICE),
    ("torch not compiled with cuda enabled", FormationError.NO_DEVICE),
    ("has no ipv4 address", FormationError.NO_INTERFACE_ADDRESS),
)


def _texts(exc: BaseException) -> list[str]:
    """The messages of ``exc`` and of every exception it was raised from (bounded)."""
    out, seen = [], 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        out.append(f"{type(cur).__name__}: {cur}")
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return out


def formation_error(exc: BaseException) -> FormationError:
    """How a failure to form a generation's group is classified: the class a shoal error
    carries (when not transient), then types (CUDA out of memory), then the message of it
    and of what it was raised from (:data:`FORMATION_PATTERNS`); TRANSIENT otherwise
    (timeouts, resets, refused connections, a peer that went away)."""
    carried = getattr(exc, "formation_error", None)
    if isinstance(carried, FormationError) and carried.configuration:
        return carried
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return FormationError.CUDA_OUT_OF_MEMORY
    except (ImportError, AttributeError):  # pragma: no cover - torch is a dependency
        pass
    for text in _texts(exc):
        lowered = text.lower()
        for fragment, kind in FORMATION_PATTERNS:
            if fragment in lowered:
                return kind
    return FormationError.TRANSIENT


def timed_out(text: str) -> bool:
    """Whether a torch/gloo/store message says something timed out."""
    lowered = text.lower()
    return "timed out" in lowered or "timeout" in lowered


def connect_cause(text: str) -> str:
    """A gloo connect failure's cause in two words: ``Connection refused``, ``timed out`` or
    ``failed``."""
    if "refused" in text.lower():
        return "Connection refused"
    return "timed out" if timed_out(text) else "failed"


def peer_connect_failed(text: str) -> bool:
    """Whether a failed gloo group creation's message is gloo failing to connect to a peer
    (not a peer missing from shoal's store, which names ``RedisStore``)."""
    return "connect" in text.lower() and "RedisStore" not in text
