"""Validation errors as one line: the one place that turns pydantic's error list into what a
person reads (a CLI message, an HTTP 422 detail, a dead-letter reason, a corrupt-file error).
Both take pydantic's ``ValidationError`` or anything with the same ``errors()`` (FastAPI's
``RequestValidationError``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def _path(loc: Sequence[object], root: str, skip: Sequence[str], name: Callable[[object], str]) -> str:
    return ".".join(name(p) for p in loc if p not in skip) or root


def first_error(exc, *, root: str = "(root)", skip: Sequence[str] = (), count: bool = False,
                name: Callable[[object], str] = str) -> str:
    """``field.path: message`` of the first error (``root`` when it has no path; ``skip``
    drops path parts such as FastAPI's ``body``; ``name`` shows each part); with ``count``,
    `` (N problems)`` when there are more."""
    errors = exc.errors()
    if not errors:
        return f"{root}: invalid"
    first = errors[0]
    more = f" ({len(errors)} problems)" if count and len(errors) > 1 else ""
    return f"{_path(first.get('loc', ()), root, skip, name)}: {first.get('msg', 'invalid')}{more}"


def every_error(exc, *, root: str = "(root)", name: Callable[[object], str] = str) -> str:
    """Every error as ``field.path: message``, joined by ``; ``."""
    return "; ".join(f"{_path(err['loc'], root, (), name)}: {err['msg']}" for err in exc.errors())
