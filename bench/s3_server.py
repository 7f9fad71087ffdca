"""The local S3 server of the benchmarks and the tests: moto's S3, served with keep-alive.

moto's S3 application runs in waitress, a production WSGI server, rather than in moto's
``ThreadedMotoServer`` (werkzeug's development server), for two costs no real S3 endpoint puts
on the machine that runs the workers:

- werkzeug's server answers every request with ``Connection: close``: each request opens a
  new TCP connection and the server starts a new thread for it (per 256 KiB GET, measured:
  server 1.2-1.6 ms of CPU against waitress's 0.9-1.0; client 0.6-0.8 against 0.5);
- moto's multi-service dispatcher lists moto's package directory on every request to find
  the service (about 40 % of the server's CPU per GET).

On a 2-core machine that CPU is taken from the workers under test (``bench/streaming.py``).
Imported as ``s3_server`` by the bench scripts (their folder is first on the path) and as
``bench.s3_server`` by the tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

#: Requests served at once (the bench's loaders read with a few threads each).
THREADS = 16


def start_moto_s3(host: str = "127.0.0.1") -> tuple[str, Callable[[], None]]:
    """Start the server on a free port of ``host``, on a thread: (its ``http://host:port``, a
    function that stops it and closes its connections)."""
    from moto.moto_server.werkzeug_app import create_backend_app
    from waitress import wasyncore
    from waitress.server import create_server

    logging.getLogger("waitress").setLevel(logging.ERROR)
    server = create_server(create_backend_app("s3"), host=host, port=0, threads=THREADS, ident="moto-s3")
    thread = threading.Thread(target=server.run, daemon=True, name="moto-s3")
    thread.start()

    def stop() -> None:
        if not thread.is_alive():
            return
        # closed by the server's own loop (closing its sockets under its select() would fail
        # there): the listening socket and every open connection; the loop then ends
        server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        thread.join(5)
        server.task_dispatcher.shutdown()

    return f"http://{host}:{server.effective_port}", stop
