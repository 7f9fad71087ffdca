"""Redis connections: the one place redis-py errors about reachability are translated.

``REDIS_URL`` (redis://, rediss://, with user/password) selects the server; when it is not
set the CLI starts or reuses the embedded server (see :mod:`shoal.ops.embedded`). URLs are
never printed with their password: use :func:`redact_url`.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from shoal.core.errors import ConnectionFailed

ENV_URL = "REDIS_URL"


#: Query parameters redis-py takes as secrets (``?password=`` works like ``user:password@``).
_SECRET_PARAMS = frozenset({"password", "ssl_password"})


def redact_url(url: str) -> str:
    """``url`` with any password (in the user part or as a query parameter) replaced by
    ``***``: safe for logs, events and status. Never raises, even for a malformed URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable Redis URL>"
    userinfo, at, hostport = parts.netloc.rpartition("@")
    netloc = f"{userinfo.partition(':')[0]}:***@{hostport}" if at and ":" in userinfo else parts.netloc
    query = parts.query
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k in _SECRET_PARAMS for k, _v in pairs):
        query = urlencode([(k, "***" if k in _SECRET_PARAMS else v) for k, v in pairs], safe="/*:")
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


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
        parts = urlsplit(url)
        db = parts.path.strip("/")
        if parts.scheme in ("redis", "rediss") and db and not db.isdigit():
            raise ValueError(f"the database {db!r} is not a number")  # redis-py would use 0 instead
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=30,
            **retrying,
        )
        # an unknown or bad query parameter (e.g. ``?ssl_certreqs=``) fails here, not at the first command
        client.connection_pool.connection_class(**client.connection_pool.connection_kwargs)
    except (ValueError, TypeError, redis.RedisError) as exc:
        raise ConnectionFailed(f"bad Redis URL {redact_url(url)}: {exc}") from exc
    if check:
        try:
            client.ping()
        except redis.AuthenticationError as exc:
            raise ConnectionFailed(f"Redis at {redact_url(url)} refused the credentials: {exc}") from exc
        except redis.RedisError as exc:
            raise ConnectionFailed(f"cannot reach Redis at {redact_url(url)}: {exc}") from exc
    return client


def without_retries(client: redis.Redis, *, timeout: float | None = None) -> redis.Redis:
    """A client to the same server (same URL, credentials, TLS, timeouts) whose commands fail
    at once instead of riding out an outage: for best-effort writes from a hot path, such as
    progress entries from the training thread. It has its own connection pool. ``timeout``
    replaces the socket and connect timeouts (a call that must return within a bound even when
    the server is blackholed, such as the commit fence)."""
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in ("retry", "retry_on_error", "retry_on_timeout")}
    if timeout is not None:
        kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout)
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class,
                                                            retry=Retry(NoBackoff(), 0), **kwargs))


def server_run_id(client: redis.Redis) -> str:
    """The server's ``run_id`` (INFO server): it changes whenever the server restarts, so a
    key that vanished while it stayed the same was deleted on purpose."""
    return str(client.info("server").get("run_id", ""))


def url_from_env() -> str | None:
    return os.environ.get(ENV_URL) or None
