"""Measuring a link's throughput between two hosts of :class:`shoal.ops.chaos.netns.Net`:
the two ends of :meth:`Net.check_link`, each run in its host's namespace.

    python .../linkcheck.py recv IP PORT WARM TIMEOUT
    python .../linkcheck.py send IP PORT SECONDS

(run as a file: it imports nothing of shoal, and starts in milliseconds)

``recv`` listens on ``IP:PORT``, prints ``listening``, takes one connection and reads it to
its end; it prints ``<bytes> <seconds>`` counted from ``WARM`` seconds after the first byte
(TCP's slow start and the queue filling are left out) to the last byte. ``send`` writes as
fast as the link takes it for ``SECONDS``, then closes. Each side gives up after its own
bound (``TIMEOUT``; the sender's connect after 5 s).
"""

from __future__ import annotations

import socket
import sys
import time

CHUNK = 1 << 16


def recv(ip: str, port: int, warm: float, timeout: float) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ip, port))
    srv.listen(1)
    srv.settimeout(timeout)
    print("listening", flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout)
    total, first, mark, mark_bytes, last = 0, None, None, 0, None
    while True:
        data = conn.recv(CHUNK)
        now = time.monotonic()
        if not data:
            break
        if first is None:
            first = now
        total += len(data)
        last = now
        if mark is None and now - first >= warm:
            mark, mark_bytes = now, total
    if mark is None or last is None or last <= mark:
        print("0 0", flush=True)
        return
    print(f"{total - mark_bytes} {last - mark:.6f}", flush=True)


def send(ip: str, port: int, seconds: float) -> None:
    sock = socket.create_connection((ip, port), timeout=5)
    sock.settimeout(seconds + 30)
    buf = b"\0" * CHUNK
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(buf)
    sock.close()


def main(argv: list[str]) -> None:
    if argv[0] == "recv":
        recv(argv[1], int(argv[2]), float(argv[3]), float(argv[4]))
    elif argv[0] == "send":
        send(argv[1], int(argv[2]), float(argv[3]))
    else:
        raise SystemExit(f"usage: recv IP PORT WARM TIMEOUT | send IP PORT SECONDS (got {argv[0]!r})")


if __name__ == "__main__":
    main(sys.argv[1:])
