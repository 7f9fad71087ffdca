"""RedisStore (worker/store.py) and join/leave (worker/process_group.py) against a real server.

Unit tests run in-process; the process-group test runs this file as a script in 3 real
processes (``python -m tests.control.test_store child RANK JOB``) doing gloo collectives over
the store across two generations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import redis
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.events.keys import job_keys
from shoal.worker.store import RedisStore, cleanup_prefix
from tests.helpers import wait_until


@pytest.fixture
def redis_store(r, job_id):
    s = RedisStore(r, job_keys(job_id).rendezvous(1), timeout=5, ttl=60)
    yield s
    s.cleanup()


def test_set_get_bytes_and_str(redis_store):
    redis_store.set("a", b"\x00\xffbin")
    redis_store.set("b", "text")
    assert redis_store.get("a") == b"\x00\xffbin"
    assert redis_store.get("b") == b"text"
    redis_store.set("a", b"new")  # overwrite
    assert redis_store.get("a") == b"new"
    assert redis_store.check(["a", "b"]) and not redis_store.check(["a", "missing"])


def test_get_wakes_every_blocked_reader_on_set(redis_store, r, redis_url, job_id):
    """Readers blocked in get() return within a fraction of a second of the set(): they are
    notified (a polling or slice-based store would take up to its slice, 5 s here)."""
    results: dict[int, tuple[bytes, float]] = {}
    names = {f"reader-{job_id}-{i}" for i in range(4)}

    def reader(i: int) -> None:
        client = redis.Redis.from_url(redis_url, socket_timeout=10, client_name=f"reader-{job_id}-{i}")
        s = RedisStore(client, redis_store.prefix, timeout=8)
        value = s.get("late")
        results[i] = (value, time.monotonic())
        client.close()

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()

    def blocked() -> set[str]:  # the readers' connections that Redis holds blocked in BLMOVE
        return {c["name"] for c in r.client_list() if c["name"] in names and "b" in c["flags"] and c["cmd"] == "blmove"}

    wait_until(lambda: blocked() == names, 10, lambda: f"every reader blocked in get() (blocked: {sorted(blocked())})")
    assert not results  # each of them is waiting, none returned without the key
    set_at = time.monotonic()
    redis_store.set("late", b"v")
    for t in threads:
        t.join(10)
    assert sorted(results) == [0, 1, 2, 3]
    for value, at in results.values():
        assert value == b"v"
        assert at - set_at < 1.0


def test_get_and_wait_time_out_with_the_torch_error(redis_store):
    redis_store.set_timeout(timedelta(seconds=0.3))
    assert redis_store.timeout == timedelta(seconds=0.3)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        redis_store.get("never")
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 2.0
    redis_store.set("x", b"1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="'never'"):  # DistStoreError is a RuntimeError
        redis_store.wait(["x", "never"], timedelta(seconds=0.2))
    assert time.monotonic() - t0 < 2.0
    redis_store.wait(["x"], timedelta(seconds=0.2))  # present: returns at once


def test_max_wait_caps_longer_timeouts_from_the_caller(r, job_id):
    """gloo passes its collective timeout to wait(); max_wait bounds the rendezvous anyway."""
    s = RedisStore(r, job_keys(job_id).rendezvous(3), timeout=30, max_wait=0.3)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], timedelta(seconds=30))
    with pytest.raises(dist.DistStoreError):
        s.get("never")
    assert time.monotonic() - t0 < 3.0


def test_keys_expire_and_cleanup_removes_only_the_prefix(r, job_id):
    keys = job_keys(job_id)
    s1 = RedisStore(r, keys.rendezvous(1), ttl=30)
    s2 = RedisStore(r, keys.rendezvous(2), ttl=30)
    s1.set("a", b"1")
    s1.add("n", 3)
    s1.compare_set("c", b"", b"x")
    s1.append("l", b"ab")
    s2.set("a", b"2")
    names = list(r.scan_iter(match=keys.rendezvous(1) + "*"))
    assert len(names) == 4
    for name in names:
        assert name.decode().startswith(keys.rendezvous(1))
        assert 0 < r.pttl(name) <= 30_000
    assert s1.num_keys() == 4 and s1.list_keys() == ["a", "c", "l", "n"]
    assert s1.cleanup() == 4
    assert not list(r.scan_iter(match=keys.rendezvous(1) + "*"))
    assert s2.get("a") == b"2"  # another generation's keys untouched
    assert cleanup_prefix(r, keys.rendezvous(2)) == 1


def test_calls_from_cpp_prefix_store_reach_the_python_methods(redis_store):
    """torch wraps the store in a C++ PrefixStore; its calls dispatch to our overrides
    (including deleteKey/getNumKeys, which the C++ trampoline looks up by their C++ names)."""
    p = dist.PrefixStore("pg/", redis_store)
    p.set("k", "v")
    assert p.get("k") == b"v"
    [name] = redis_store.list_keys()
    assert name.startswith("pg/") and name.endswith("/k") and redis_store.get(name) == b"v"
    assert p.add("cnt", 2) == 2 and p.add("cnt", 5) == 7
    assert p.compare_set("k", "v", "w") == b"w"
    assert p.num_keys() == 2
    assert p.delete_key("k") and not p.delete_key("k")
    p.multi_set(["m1", "m2"], ["1", "2"])
    assert p.multi_get(["m1", "m2"]) == [b"1", b"2"]
    with pytest.raises(dist.DistStoreError):
        p.wait(["absent"], timedelta(seconds=0.1))


def test_rejects_decoded_clients_and_empty_prefix(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        RedisStore(client, "p:")
    with pytest.raises(ValueError):
        RedisStore(redis.Redis.from_url(redis_url), "")


# --- same behaviour as torch's own HashStore ------------------------------------------------
keys_st = st.sampled_from(["a", "b", "c"])
vals_st = st.binary(max_size=6)
ops_st = st.lists(
    st.one_of(
        st.tuples(st.just("set"), keys_st, vals_st),
        st.tuples(st.just("add"), keys_st, st.integers(-5, 5)),
        st.tuples(st.just("cas"), keys_st, st.sampled_from([b"", b"1", b"x"]), vals_st),
        st.tuples(st.just("delete"), keys_st),
        st.tuples(st.just("check"), keys_st),
        st.tuples(st.just("get"), keys_st),
        st.tuples(st.just("append"), keys_st, vals_st),
        st.tuples(st.just("num_keys")),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_st)
def test_same_results_as_torch_hashstore(r, job_id, ops):
    """Any sequence of store operations gives the same results on RedisStore and HashStore."""
    ours = RedisStore(r, f"{job_keys(job_id).base}:rdzv:h{time.monotonic_ns()}:", timeout=1)
    ref = dist.HashStore()
    ref.set_timeout(timedelta(seconds=1))
    try:
        for op in ops:
            results = []
            for s in (ours, ref):
                name = op[0]
                try:
                    if name == "set":
                        out = s.set(op[1], op[2])
                    elif name == "add":
                        out = s.add(op[1], op[2])
                    elif name == "cas":
                        out = s.compare_set(op[1], op[2], op[3])
                    elif name == "delete":
                        out = s.delete_key(op[1])
                    elif name == "check":
                        out = s.check([op[1]])
                    elif name == "get":
                        out = s.get(op[1]) if s.check([op[1]]) else None
                    elif name == "append":
                        out = s.append(op[1], op[2])
                    else:
                        out = s.num_keys()
                except Exception as exc:  # e.g. add on a non-integer value: both must fail
                    out = "error"
                    assert name == "add", exc
                results.append(out)
            assert results[0] == results[1], (op, results)
    finally:
        ours.cleanup()


# --- real processes: gloo over the store, two generations -------------------------------------
def _child(rank: int, job: str) -> None:
    import torch

    from shoal.core.connection import connect
    from shoal.worker import process_group as pg
    from shoal.worker.errors import RendezvousTimeout, WorkerError

    client = connect(os.environ["REDIS_URL"], timeout=10)
    rendezvous = pg.Rendezvous(client, job)
    out: dict[str, object] = {"rank": rank}
    # generation 1: ranks as given
    t0 = time.monotonic()
    g = rendezvous.join(1, rank, 3, 60)
    out["rdzv1"] = time.monotonic() - t0
    x = torch.full((4,), float(rank + 1))
    g.all_reduce(x)
    y = torch.tensor([rank * 10.0, 1.0])
    g.broadcast(y, src=2)
    g.barrier()
    out["g1"] = {"sum": x.tolist(), "bcast": y.tolist(), "prefix": g.store.prefix, "world": g.world_size}
    rendezvous.close_joined()
    # generation 2 in the same processes: fresh prefix, ranks rotated
    new_rank = (rank + 1) % 3
    g = rendezvous.join(2, new_rank, 3, 60)
    x = torch.tensor([float(2**new_rank)], dtype=torch.float64)
    g.all_reduce(x, dist.ReduceOp.MAX)
    z = torch.tensor([float(new_rank)])
    g.all_reduce(z)
    g.broadcast(y := torch.tensor([float(new_rank)]), src=0)
    g.barrier()
    out["g2"] = {"rank": dist.get_rank(), "max": x.item(), "sum": z.item(), "bcast": y.item(), "prefix": g.store.prefix}
    rendezvous.close_joined()
    try:
        rendezvous.join(1, rank, 3, 5)
        out["reuse"] = "allowed"
    except WorkerError as exc:
        out["reuse"] = type(exc).__name__
    if rank == 0:  # a generation whose peer never comes: bounded by the timeout
        t0 = time.monotonic()
        try:
            rendezvous.join(3, 0, 2, 1.5, collective_timeout=60)
            out["lonely"] = "joined?!"
        except RendezvousTimeout:
            out["lonely"] = "RendezvousTimeout"
        out["lonely_s"] = time.monotonic() - t0
        out["after_timeout_initialized"] = dist.is_initialized()
    print("RESULT " + json.dumps(out), flush=True)


@pytest.mark.slow
def test_gloo_over_redis_store_in_three_processes_across_generations(r, job_id, subprocess_env):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, "child", str(rank), job_id],
            env=subprocess_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    results = {}
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")][-1]
            res = json.loads(line[len("RESULT "):])
            results[res["rank"]] = res
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    keys = job_keys(job_id)
    for rank, res in results.items():
        assert res["g1"]["sum"] == [6.0] * 4
        assert res["g1"]["bcast"] == [20.0, 1.0]  # rank 2's tensor
        assert res["g1"]["prefix"] == keys.rendezvous(1) and res["g1"]["world"] == 3
        assert res["g2"]["rank"] == (rank + 1) % 3
        assert res["g2"] == {**res["g2"], "max": 4.0, "sum": 3.0, "bcast": 0.0, "prefix": keys.rendezvous(2)}
        assert res["reuse"] == "WorkerError"
    assert results[0]["lonely"] == "RendezvousTimeout"
    assert 1.4 <= results[0]["lonely_s"] < 10  # the rendezvous timeout, not the 60 s collective one
    assert results[0]["after_timeout_initialized"] is False
    # both generations' stores were written under their own prefix, with expiries
    for gen in (1, 2):
        names = list(r.scan_iter(match=keys.rendezvous(gen) + "*"))
        assert names and all(0 < r.pttl(n) <= 3_600_000 for n in names)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "child":
        _child(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit("usage: test_store.py child RANK JOB_ID")


def test_claims_take_the_own_block_from_the_front_then_the_back_of_the_block_furthest_from_done(redis_store):
    """:meth:`RedisStore.claim` (slices evened out within a step): rank 1's block first, in
    order; then the last untaken chunk of the block with the largest share of its chunks left
    (ties: the lower block); None once every chunk is taken, for every rank."""
    chunks = [4, 2, 6]
    got = []
    while (c := redis_store.claim("steal/3/10", 1, chunks)) is not None:
        got.append(c)
    assert got[:2] == [(1, 0), (1, 1)]
    # then 4/4 vs 6/6 left: block 0 (the lower), its back; then 6/6 > 3/4: block 2's back ...
    assert got[2:5] == [(0, 3), (2, 5), (2, 4)]
    assert sorted(got) == [(b, i) for b, n in enumerate(chunks) for i in range(n)]
    assert redis_store.claim("steal/3/10", 0, chunks) is None and redis_store.claim("steal/3/10", 2, chunks) is None
    # another step's key starts afresh; a block out of range is refused before Redis
    assert redis_store.claim("steal/3/11", 2, chunks) == (2, 0)
    with pytest.raises(ValueError, match="block 3"):
        redis_store.claim("steal/3/11", 3, chunks)


def test_concurrent_claims_give_every_chunk_exactly_once(r, redis_url, job_id):
    """Three ranks on their own connections claim until nothing is left, at different speeds:
    each chunk goes to exactly one of them, and each rank's own block's chunks that it took
    came in order from the front."""
    prefix = job_keys(job_id).rendezvous(7)
    chunks = [10, 10, 30]
    taken: dict[int, list[tuple[int, int]]] = {}

    def rank(i: int) -> None:
        client = redis.Redis.from_url(redis_url)
        store = RedisStore(client, prefix)
        mine = taken.setdefault(i, [])
        while (c := store.claim("steal/7/1", i, chunks)) is not None:
            mine.append(c)
            time.sleep(0.0005 * (i + 1) ** 2)  # rank 2 is 9x slower than rank 0
        client.close()

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    every = [c for i in range(3) for c in taken[i]]
    assert sorted(every) == [(b, i) for b, n in enumerate(chunks) for i in range(n)]
    for i in range(3):
        own = [idx for b, idx in taken[i] if b == i]
        assert own == list(range(len(own))), (i, own)
    # the slow rank did not train all of its block: the others took chunks of it
    assert len([1 for b, _ in taken[2] if b == 2]) < chunks[2], taken[2]
