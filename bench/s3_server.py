"""The local S3 server of the benchmarks and the tests: moto serving S3 only.

Not ``moto.server.ThreadedMotoServer``: its multi-service dispatcher lists moto's package
directory on every request to find the service (about 40 % of the server's CPU per GET,
measured on a 256 KiB object), a cost no real S3 endpoint has; on a 2-core machine that CPU
is taken from the workers under test (``bench/streaming.py``). Imported as ``s3_server`` by the
bench scripts (their folder is first on the path) and as ``bench.s3_server`` by the tests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def start_moto_s3(host: str = "127.0.0.1") -> tuple[str, Callable[[], None]]:
    """Start the server on a free port of ``host``, on a thread: (its ``http://host:port``, a
    function that stops it)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server(host, 0, create_backend_app("s3"), threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="moto-s3").start()
    return f"http://{host}:{server.server_port}", server.shutdown
