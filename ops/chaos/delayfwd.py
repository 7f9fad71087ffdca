"""A user-space delay line for :meth:`shoal.ops.chaos.netns.Net.delay` (this kernel has no
netem): two TAP devices, every Ethernet frame read from one is written to the other ``MS``
milliseconds later, in order. TAP devices without a virtio header get frames already
segmented to the MTU, so nothing is too big to pass. The devices live as long as this
process; it runs in the switch namespace and is killed with it.

    python -m shoal.ops.chaos.delayfwd TAP_A TAP_B MS
"""

from __future__ import annotations

import fcntl
import heapq
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    os.set_blocking(fd, False)
    return fd


def main(argv: list[str]) -> None:
    a_name, b_name, ms = argv[0], argv[1], float(argv[2])
    a, b = open_tap(a_name), open_tap(b_name)
    other = {a: b, b: a}
    held: list[tuple[float, int, int, bytes]] = []  # (due, order, out fd, frame)
    order = 0
    print("ready", flush=True)
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([a, b], [], [], wait)
        due = time.monotonic() + ms / 1000
        for fd in readable:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                heapq.heappush(held, (due, order, other[fd], frame))
                order += 1
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, frame = heapq.heappop(held)
            try:
                os.write(out, frame)
            except OSError:
                pass  # the device is down (link_down): the frame is lost, as on a wire


if __name__ == "__main__":
    main(sys.argv[1:])
