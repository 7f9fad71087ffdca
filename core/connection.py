"""Redis connections: the one place redis-py errors about reachability are translated.

``REDIS_URL`` (redis://, rediss://, with user/password) selects the server; when it is not
set the CLI starts or reuses the embedded server (see :mod:`shoal.ops.embedded`). URLs are
never printed with their password: use :func:`redact_url`.

A Redis under Sentinel is named ``redis+sentinel://[user:password@]h1:p1,h2:p2,h3:p3/<service>[/<db>]``
(``rediss+sentinel://`` for TLS to the data nodes): the client asks the sentinels which node is
the primary of ``<service>`` and asks again after a fail-over; the password is the data nodes'
(and, by default, the sentinels': ``?sentinel_password=`` sets theirs apart). Such a client
is a :class:`ReplicatedRedis`: it knows that the deployment has replicas, and
:func:`replicas_to_wait` is 1 (see :mod:`shoal.core.durable`).
"""

from __future__ import annotations

import functools
import math
import os
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from shoal.events import envvars
from shoal.core.errors import ConnectionFailed

ENV_URL = "REDIS_URL"


#: Query parameters redis-py takes as secrets (``?password=`` works like ``user:password@``).
_SECRET_PARAMS = frozenset({"password", "ssl_password", "sentinel_password"})
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")


class ReplicatedRedis(redis.Redis):
    """A client of a Redis deployment with replicas (a Sentinel set): its durable writes and
    reads wait for :attr:`replicas` of them to confirm (:func:`replicas_to_wait`,
    :mod:`shoal.core.durable`). :func:`connect` makes one for a ``redis+sentinel://`` URL and
    :func:`without_retries` keeps it one; a harness that talks to such a deployment's primary
    directly (over a unix socket, say) makes its own: ``ReplicatedRedis(unix_socket_path=...)``.
    Any other client is a plain ``redis.Redis``, whose durable writes wait for none."""

    def __init__(self, *args, replicas: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: how many replicas confirm a durable write or read (>= 0)
        self.replicas = replicas


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
    losing their process); ``math.inf`` for as long as it takes (a process whose every Redis
    call may wait, such as the queue agent's RQ bookkeeping); 0 makes errors surface at once
    (the coordinator handles outages itself, so that it knows to reload its state).

    Raises ConnectionFailed (naming the redacted URL and the cause) when the server cannot be
    reached, refuses authentication, or the URL is malformed.
    """
    retrying: dict = {}
    if ride_out > 0:
        cap, base = 1.0, 0.05
        errors = (redis.ConnectionError, redis.TimeoutError)
        # an infinite ride-out retries for as long as it takes (redis-py: retries < 0)
        retries = -1 if math.isinf(ride_out) else max(1, int(ride_out / cap) + 5)
        retrying = dict(retry=Retry(ExponentialBackoff(cap=cap, base=base), retries=retries,
                                    supported_errors=errors),
                        retry_on_error=list(errors))
    try:
        parts = urlsplit(url)
        if parts.scheme in SENTINEL_SCHEMES:
            client = _sentinel_client(parts, timeout, retrying)
        else:
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


def _sentinel_client(parts, timeout: float, retrying: dict) -> redis.Redis:
    """The primary of the URL's service, found (and found again after a fail-over) through
    its sentinels."""
    from redis.sentinel import Sentinel

    userinfo, _at, hosts = parts.netloc.rpartition("@")
    user, _colon, password = userinfo.partition(":")
    nodes = []
    for hostport in hosts.split(","):
        host, colon, port = hostport.rpartition(":")
        if not colon or not port.isdigit() or not host:
            raise ValueError(f"sentinel address {hostport!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("the path must be /<service> or /<service>/<db number>")
    params = dict(parse_qsl(parts.query))
    unknown = set(params) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))} (only sentinel_password)")
    auth = {"username": unquote(user) or None, "password": unquote(password) or None}
    sentinel_auth = {"password": params.get("sentinel_password", auth["password"]),
                     "username": auth["username"] if "sentinel_password" not in params else None}
    sentinel = Sentinel(nodes, sentinel_kwargs=dict(socket_timeout=timeout, socket_connect_timeout=timeout,
                                                    **{k: v for k, v in sentinel_auth.items() if v}),
                        socket_timeout=timeout, socket_connect_timeout=timeout)
    client = sentinel.master_for(path[0], db=int(path[1]) if len(path) == 2 else 0, socket_timeout=timeout,
                                 socket_connect_timeout=timeout, health_check_interval=30,
                                 connection_class=_sentinel_classes()[parts.scheme == "rediss+sentinel"],
                                 redis_class=ReplicatedRedis, **{k: v for k, v in auth.items() if v}, **retrying)
    return client


@functools.cache
def _sentinel_classes() -> tuple[type, type]:
    """redis-py's Sentinel connections (plain, TLS) that ask the sentinels for the primary on
    every socket connect. redis-py's own ask only in ``connect()``: a reconnect from inside a
    command's retry (``connect_check_health``) reuses the address the connection had, so a
    worker riding out a fail-over kept dialling the dead primary for its whole ride-out (60 s
    seen) while a replica had been promoted 2 s after the kill.

    They also drop the connection when a reply's read is interrupted (an exception raised by a
    signal handler, e.g. RQ's warm shutdown during its blocking dequeue), as redis-py's plain
    connections do: its Sentinel ones default to keeping it, so the unread reply answered the
    next command on that connection ("Wrong number of response items from pipeline
    execution": an idle ``shoal agent --queue`` under Sentinel exited 3 on SIGTERM)."""
    from redis.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

    class Rediscover:
        def _connect(self):
            if self.connection_pool.is_master:
                self.host, self.port = self.connection_pool.get_master_address()
            return super()._connect()

        def read_response(self, disable_decoding=False, *, disconnect_on_error=True, **kwargs):
            return super().read_response(disable_decoding=disable_decoding, disconnect_on_error=disconnect_on_error,
                                         **kwargs)

    class Plain(Rediscover, SentinelManagedConnection):
        pass

    class TLS(Rediscover, SentinelManagedSSLConnection):
        pass

    return Plain, TLS


def replicas_to_wait(client: redis.Redis) -> int:
    """How many replicas a durable write waits for on ``client``'s server: a
    :class:`ReplicatedRedis`'s ``replicas`` (1 under Sentinel, ``redis+sentinel://``), 0 for
    any other client; ``SHOAL_REDIS_WAIT_REPLICAS`` overrides."""
    env = envvars.REDIS_WAIT_REPLICAS.get()
    if env.isdigit():
        return int(env)
    return client.replicas if isinstance(client, ReplicatedRedis) else 0


def without_retries(client: redis.Redis, *, timeout: float | None = None) -> redis.Redis:
    """A client to the same server (same URL, credentials, TLS, timeouts, replicas to wait
    for) whose commands fail
    at once instead of riding out an outage: for best-effort writes from a hot path, such as
    progress entries from the training thread. It has its own connection pool. ``timeout``
    replaces the socket and connect timeouts (a call that must return within a bound even when
    the server is blackholed, such as the commit fence)."""
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items()
              if k not in ("retry", "retry_on_error", "retry_on_timeout", "connection_pool")}
    if timeout is not None:
        kwargs.update(socket_timeout=timeout, socket_connect_timeout=timeout)
    if hasattr(pool, "sentinel_manager"):  # under Sentinel: the same service, found the same way
        from redis.sentinel import SentinelConnectionPool

        fresh = SentinelConnectionPool(pool.service_name, pool.sentinel_manager, retry=Retry(NoBackoff(), 0),
                                       connection_class=pool.connection_class, **kwargs)
    else:
        fresh = redis.ConnectionPool(connection_class=pool.connection_class, retry=Retry(NoBackoff(), 0), **kwargs)
    if isinstance(client, ReplicatedRedis):
        return ReplicatedRedis(connection_pool=fresh, replicas=client.replicas)
    return redis.Redis(connection_pool=fresh)


def server_run_id(client: redis.Redis) -> str:
    """The server's ``run_id`` (INFO server): it changes whenever the server restarts, so a
    key that vanished while it stayed the same was deleted on purpose."""
    return str(client.info("server").get("run_id", ""))


def url_from_env() -> str | None:
    return os.environ.get(ENV_URL) or None
