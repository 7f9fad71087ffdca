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
print("ready", flush=True)  # imports done: the rendezvous starts together (as after the Redis barrier)
pg.Rendezvous(client, sys.argv[2], backend="gloo").join(1, 1, 2, 30, collective_timeout=60)
print("joined", flush=True)
time.sleep(120)  # hung: never takes part in a collective
"""


def test_an_abort_ends_a_collective_with_a_hung_peer_at_once(r: redis.Redis, job_id: str, redis_url: str) -> None:
    peer = subprocess.Popen([sys.executable, "-c", PEER, redis_url, job_id], stdout=subprocess.PIPE, text=True)
    rendezvous = pg.Rendezvous(r, job_id, backend="gloo")
    try:
        assert peer.stdout.readline().strip() == "ready"  # on a loaded machine torch's import takes seconds
        group = rendezvous.join(1, 0, 2, 30, collective_timeout=60)
        assert peer.stdout.readline().strip() == "joined"
        timer = threading.Timer(0.3, rendezvous.request_abort, args=(1, "generation 2 evicted w1"))
        timer.start()
        started = time.monotonic()
        try:
            group.all_reduce(torch.ones(4))
            raise AssertionError("the all-reduce with a hung peer returned")
        except CollectiveFailed as exc:
            assert "all_reduce: aborted (generation 2 evicted w1)" in str(exc)
        took = time.monotonic() - started
        assert took < 10, f"the abort took {took:.1f} s (the collective timeout is 60 s)"
        assert group.abort_reason == "generation 2 evicted w1"
        assert not rendezvous.request_abort(1, "again")  # once
        assert not rendezvous.request_abort(7, "another generation")
        try:  # every later collective of the aborted group fails before it starts
            group.barrier()
            raise AssertionError("a collective of an aborted group ran")
        except CollectiveFailed as exc:
            assert "barrier: aborted" in str(exc)
        left = time.monotonic()
        rendezvous.close_joined()  # does not wait for the stuck collective
        assert time.monotonic() - left < 5
        assert rendezvous.joined is None
        nxt = rendezvous.join(2, 0, 1, 30)  # the next generation forms at once
        assert not nxt.abort_reason  # the abort died with its group
        assert not rendezvous.request_abort(1, "late: generation 1's group is gone")
        t = torch.full((3,), 2.0)
        nxt.all_reduce(t)
        assert t.tolist() == [2.0, 2.0, 2.0] and not nxt.abort_reason
        rendezvous.close_joined()
    finally:
        peer.kill()
        peer.wait(10)
        rendezvous.close_joined()
