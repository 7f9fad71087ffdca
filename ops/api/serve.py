"""Running the API: ``shoal serve [--host H] [--port P] [--token-file F]``.

Binds 127.0.0.1 unless told otherwise, connects to ``REDIS_URL`` (or the running embedded
server, like every other ``shoal`` command) without requiring it to answer yet - ``/health``
says 503 until it does - and serves with uvicorn until SIGINT/SIGTERM (open event streams
get :data:`GRACE_S` seconds to close). The access log has method, path and status only:
tokens travel in a header and are never logged.
"""

from __future__ import annotations

import logging
import socket

import uvicorn

from shoal.core.connection import connect, redact_url
from shoal.core.errors import ConfigError
from shoal.ops.api.app import create_app
from shoal.ops.api.auth import ENV_TOKEN, load_token
from shoal.ops.embedded import redis_url

log = logging.getLogger("shoal.serve")

#: Seconds open connections (event streams) get to finish at shutdown.
GRACE_S = 5


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port); ConfigError naming the
    address when it cannot be had (in use, not an address of this machine, ...)."""
    try:
        family, kind, proto, _name, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _url_host(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def serve(*, host: str, port: int, token_file: str | None) -> int:
    """Serve until interrupted; returns the exit status. ConfigError (one line) for a bad
    token, address or Redis URL, before anything is served."""
    token = load_token(token_file)
    url, _server = redis_url(start_embedded=False)
    client = connect(url, check=False)  # /health reports an unreachable Redis; the server still starts
    sock = bind(host, port)
    base = _url_host(sock)
    log.info("listening on %s (dashboard %s/, API %s/jobs, OpenAPI %s/openapi.json); Redis %s",
             base, base, base, base, redact_url(url))
    if token is None:
        log.warning("read-only: no API token configured (set %s or --token-file); calls that change anything "
                    "are refused", ENV_TOKEN)
    elif not sock.getsockname()[0].startswith("127.") and sock.getsockname()[0] != "::1":
        log.warning("listening beyond this machine over plain HTTP: the token crosses the network in clear text; "
                    "put TLS (a reverse proxy, an ingress) in front")
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - reported, served anyway (503 until Redis answers)
        log.warning("Redis at %s does not answer yet (%s); /health says 503 until it does",
                    redact_url(url), str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    config = uvicorn.Config(create_app(client, token=token), log_config=None, access_log=True, server_header=False,
                            proxy_headers=False, timeout_graceful_shutdown=GRACE_S, lifespan="off")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
        client.close()
    return 0
