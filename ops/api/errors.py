"""How the API answers errors: always ``{"detail": "<one line>"}``, never a traceback.

=========================================  ======  ==========================================
cause                                      status  detail
=========================================  ======  ==========================================
an unknown job (:class:`NoSuchJob`)        404     ``no job 'x' in this Redis``
a job name taken (:class:`JobExists`)      409     ``job 'x' already exists ...``
bad input (ConfigError, a malformed body)  422     the field and what is wrong with it
another refusal (ShoalError)               409     what was refused and why
Redis unreachable or failing               503     ``Redis unavailable: <reason>``
a bug                                      500     ``internal error (...)``; the log has it
=========================================  ======  ==========================================

Redis errors name the host and port at most (redis-py never puts the password in them).
"""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.core.errors import ConfigError, ConnectionFailed, ShoalError
from shoal.core.registry import JobExists
from shoal.core.yamlfile import escape_controls, printable
from shoal.ops.jobs import NoSuchJob
from shoal.events.validation import first_error

log = logging.getLogger("shoal.api")

#: Longest detail sent back.
MAX_DETAIL = 500


class Detail(BaseModel):
    """Every error's body."""

    detail: str = Field(description="what went wrong, one line")


def described(**codes: str) -> dict:
    """OpenAPI ``responses`` entries of error answers (their body: :class:`Detail`)."""
    return {int(code.lstrip("_")): {"model": Detail, "description": text} for code, text in codes.items()}


#: The errors any endpoint may answer.
COMMON = described(_422="bad input: one line naming the field or parameter", _503="Redis unavailable")


def one_line(exc: BaseException | str) -> str:
    """``exc`` as one printable line of at most :data:`MAX_DETAIL` characters."""
    text = str(exc).strip().splitlines()
    line = escape_controls(text[0] if text else type(exc).__name__)
    return line if len(line) <= MAX_DETAIL else line[: MAX_DETAIL - 3] + "..."


def _answer(status: int, detail: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"detail": one_line(detail)}, status_code=status, headers=headers)


def status_of(exc: ShoalError) -> int:
    if isinstance(exc, NoSuchJob):
        return 404
    if isinstance(exc, JobExists):
        return 409
    if isinstance(exc, ConnectionFailed):
        return 503
    if isinstance(exc, ConfigError):
        return 422
    return 409


def _validation_detail(exc: RequestValidationError) -> str:
    if not exc.errors():
        return "invalid request"
    return first_error(exc, root="body", skip=("body",), count=True, name=printable)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every error into a one-line JSON detail."""

    @app.exception_handler(ShoalError)
    async def _shoal(_request: Request, exc: ShoalError) -> JSONResponse:
        return _answer(status_of(exc), str(exc))

    @app.exception_handler(redis.RedisError)
    async def _redis(_request: Request, exc: redis.RedisError) -> JSONResponse:
        log.warning("Redis error: %s", one_line(exc))
        return _answer(503, f"Redis unavailable: {exc}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _answer(422, _validation_detail(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _answer(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _answer(500, f"internal error ({type(exc).__name__}); the server's log has the details")
