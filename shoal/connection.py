"""Redis connections: the one place redis-py errors about reachability are translated.

``REDIS_URL`` (redis://, rediss://, with user/password) selects the server; when it is not
set the CLI starts or reuses the embedded server (see :mod:`shoal.embedded`). URLs are
never printed with their password: use :func:`redact_url`.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shoal.errors import ConnectionFailed

ENV_URL = "REDIS_URL"


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (safe for logs, events and status)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


def connect(url: str, *, timeout: float = 5.0, check: bool = True, ride_out: float = 0.0) -> redis.Redis:
    """A client for ``url`` with explicit socket timeouts; with ``check`` it PINGs first.

    ``ride_out`` > 0 makes every command retry connection errors with exponential backoff
    for about that many seconds (workers use it to live through a Redis restart without
    losing their process); 0 makes errors surface at once (the coordinator handles outages
    itself, so that it knows to reload its state).

    Raises ConnectionFailed (naming the redacted URL and the cause) when the server cannot be
    reached, refuses authentication, or the URL is malformed.
    """
    retrying: dict = {}
    if ride_out > 0:
        cap, base = 1.0, 0.05
        errors = (redis.ConnectionError, redis.TimeoutError)
        retrying = dict(retry=Retry(ExponentialBackoff(cap=cap, base=base), retries=max(1, int(ride_out / cap) + 5),
                                    supported_errors=errors),
                        retry_on_error=list(errors))
    try:
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
            **retrying,
        )
    except ValueError as exc:
        raise ConnectionFailed(f"bad Redis URL {redact_url(url)}: {exc}") from exc
    if check:
        try:
            client.ping()
        except redis.AuthenticationError as exc:
            raise ConnectionFailed(f"Redis at {redact_url(url)} refused the credentials: {exc}") from exc
        except redis.RedisError as exc:
            raise ConnectionFailed(f"cannot reach Redis at {redact_url(url)}: {exc}") from exc
    return client


def url_from_env() -> str | None:
    return os.environ.get(ENV_URL) or None
