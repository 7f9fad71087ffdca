"""Aborting a group's collectives (real Redis, real gloo, a real second process).

The peer joins generation 1 and then hangs (it never enters the all-reduce). An abort
requested from another thread - what the watcher does when a table evicts that peer - must
end the all-reduce in flight at once, long before the group's collective timeout, make
every later collective of that group fail before it starts, and let the next generation
form at once while the abandoned collective is still stuck.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import redis
import torch

from shoal.worker import process_group as pg
from shoal.worker.errors import CollectiveFailed

PEER = """
import sys, time
from shoal.core.connection import connect
from shoal.worker import process_group as pg
client = connect(sys.argv[1])
pg.join_group(client, sys.argv[2], 1, 1, 2, timeout=30, collective_timeout=60, backend="gloo")
print("joined", flush=True)
time.sleep(120)  # hung: never takes part in a collective
"""


def test_an_abort_ends_a_collective_with_a_hung_peer_at_once(r: redis.Redis, job_id: str, redis_url: str) -> None:
    peer = subprocess.Popen([sys.executable, "-c", PEER, redis_url, job_id], stdout=subprocess.PIPE, text=True)
    try:
        pg.join_group(r, job_id, 1, 0, 2, timeout=30, collective_timeout=60, backend="gloo")
        assert peer.stdout.readline().strip() == "joined"
        timer = threading.Timer(0.3, pg.request_abort, args=(1, "generation 2 evicted w1"))
        timer.start()
        started = time.monotonic()
        try:
            pg.all_reduce(torch.ones(4))
            raise AssertionError("the all-reduce with a hung peer returned")
        except CollectiveFailed as exc:
            assert "all_reduce: aborted (generation 2 evicted w1)" in str(exc)
        took = time.monotonic() - started
        assert took < 10, f"the abort took {took:.1f} s (the collective timeout is 60 s)"
        assert pg.aborted() == "generation 2 evicted w1"
        assert not pg.request_abort(1, "again")  # once
        assert not pg.request_abort(7, "another generation")
        try:  # every later collective of the aborted group fails before it starts
            pg.barrier()
            raise AssertionError("a collective of an aborted group ran")
        except CollectiveFailed as exc:
            assert "barrier: aborted" in str(exc)
        left = time.monotonic()
        pg.leave_group()  # does not wait for the stuck collective
        assert time.monotonic() - left < 5
        assert pg.aborted() == ""
        pg.join_group(r, job_id, 2, 0, 1, timeout=30, backend="gloo")  # the next generation forms at once
        t = torch.full((3,), 2.0)
        pg.all_reduce(t)
        assert t.tolist() == [2.0, 2.0, 2.0]
        pg.leave_group()
    finally:
        peer.kill()
        peer.wait(10)
        pg.leave_group()
