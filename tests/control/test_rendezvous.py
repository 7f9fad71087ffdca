"""The O(W) rendezvous of issue 17 against a real server, in one process: gloo's full mesh
over the store's address table (real gloo groups, one per thread), and the generation barrier
(worker/barrier.py). Redis commands are counted on the client side (every command a client
sends), so the tests check how many round trips each rank makes - never how long they take.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import redis
import torch
import torch.distributed as dist

from shoal.events.keys import RENDEZVOUS_TTL_S, job_keys
from shoal.worker.barrier import GenerationBarrier
from shoal.worker.store import RedisStore
from tests.helpers import wait_until


class CountingRedis(redis.Redis):
    """A client that counts the commands it sends (a script call is one)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def execute_command(self, *args, **options):
        self.sent.append(str(args[0]).lower())
        return super().execute_command(*args, **options)


class CallLog(RedisStore):
    """A store that records the torch-side calls gloo makes on it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str]] = []

    def set(self, key, value):
        self.calls.append(("set", key))
        return super().set(key, value)

    def get(self, key):
        self.calls.append(("get", key))
        return super().get(key)

    def wait(self, keys, timeout=None):
        self.calls.extend(("wait", k) for k in keys)
        return super().wait(keys, timeout)

    def multi_get(self, keys):
        self.calls.extend(("multi_get", k) for k in keys)
        return super().multi_get(keys)


def _mesh(redis_url: str, prefix: str, world: int, *, table: bool) -> dict[int, tuple[list[float], CallLog, CountingRedis]]:
    """Form one gloo group of ``world`` ranks (a thread each) over the store at ``prefix`` and
    all-reduce each rank's number; per rank: the result, its store and its client."""
    out: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            client = CountingRedis.from_url(redis_url, socket_timeout=60)  # one blocking read: 30 s
            extra = {"rank": rank, "world_size": world} if table else {}
            store = CallLog(client, prefix, timeout=20, **extra)
            client.sent.clear()  # count the rendezvous only
            group = dist.ProcessGroupGloo(dist.PrefixStore("0/", store), rank, world, timedelta(seconds=20))
            n = len(client.sent)
            x = torch.tensor([float(rank)])
            group.allreduce([x]).wait()
            out[rank] = (x.tolist(), store, client, n)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_gloo_reads_every_peer_address_from_one_table_per_group(r, redis_url, job_id) -> None:
    """gloo (torch 2.13) sets ``base/<rank>`` once and then waits for and gets every rank's
    key, itself included: W (2W + 1) blocking reads per group key by key. From the table each
    rank sends one script call and at most one blocking read - the group O(W) commands."""
    world = 6
    keys = job_keys(job_id)
    # the server has the scripts already (as it has after a job's first group): no NOSCRIPT
    # round trips in the counts
    RedisStore(r, keys.rendezvous(0), rank=0, world_size=1).set("warm/0", b"")
    mesh = _mesh(redis_url, keys.rendezvous(1), world, table=True)
    for rank, (result, store, client, sent) in mesh.items():
        assert result == [float(sum(range(world)))]
        # what gloo asks of the store: its own address once, then every rank's
        sets = [k for op, k in store.calls if op == "set"]
        base = sets[0].rsplit("/", 1)[0]
        assert sets == [f"{base}/{rank}"]
        reads = [(op, k) for op, k in store.calls if op != "set"]
        assert {k for _, k in reads} == {f"{base}/{i}" for i in range(world)}
        # ... served by one script call and at most one blocking read (the rank whose call
        # completed the table: none)
        assert client.sent[0] == "evalsha" and len(client.sent) == sent <= 2, client.sent
    assert sum(sent for *_, sent in mesh.values()) == 2 * world - 1
    # the table keys live under the generation's prefix and expire with it
    for name in r.scan_iter(match=keys.rendezvous(1) + "*"):
        assert 0 < r.pttl(name) <= RENDEZVOUS_TTL_S * 1000

    # side by side: the same group read key by key (the store without rank and world size)
    legacy = _mesh(redis_url, keys.rendezvous(2), world, table=False)
    assert all(result == [float(sum(range(world)))] for result, *_ in legacy.values())
    assert all(sent >= 2 * world + 1 for *_, sent in legacy.values())


def test_a_rank_missing_from_the_table_is_named_and_an_abort_ends_the_wait(r, job_id) -> None:
    prefix = job_keys(job_id).rendezvous(1)
    reason = {"why": ""}
    s0 = RedisStore(r, prefix, timeout=0.3, rank=0, world_size=3, abort=lambda: reason["why"])
    s1 = RedisStore(r, prefix, timeout=0.3, rank=1, world_size=3)
    s0.set("m/0", b"a0")
    s1.set("m/1", b"a1")
    with pytest.raises(dist.DistStoreError, match=r"timed out .*ranks that never published theirs: \[2\]"):
        s0.wait(["m/1"])
    s0.set_timeout(timedelta(seconds=60))
    timer = threading.Timer(0.2, reason.update, kwargs={"why": "generation 2 evicted w2"})
    timer.start()
    with pytest.raises(dist.DistStoreError, match=r"aborted .*generation 2 evicted w2.*\[2\]"):
        s0.get("m/2")  # an abort ends the wait within ABORT_POLL_S, not the 60 s timeout
    timer.join()
    reason["why"] = ""
    s2 = RedisStore(r, prefix, timeout=5, rank=2, world_size=3)
    s2.set("m/2", b"a2")  # completes the table: its own reads need no blocking call
    assert [s2.get(f"m/{i}") for i in range(3)] == [b"a0", b"a1", b"a2"]
    assert s0.multi_get(["m/2", "m/0"]) == [b"a2", b"a0"]
    assert s0.check(["m/0", "m/1", "m/2"])  # the keys themselves exist too


def test_keys_not_published_by_their_own_rank_are_read_one_by_one(r, job_id) -> None:
    """A key only rank 0 writes (a NCCL unique id) and a key of a table base written other
    than by set() are read as before: the table never waits for ranks that will not publish."""
    prefix = job_keys(job_id).rendezvous(1)
    s0 = RedisStore(r, prefix, timeout=2, rank=0, world_size=2)
    s1 = RedisStore(r, prefix, timeout=2, rank=1, world_size=2)
    s0.set("nccl/0", b"unique-id")
    assert s1.get("nccl/0") == b"unique-id"  # rank 1 never published in "nccl"
    s1.set("t/1", b"v1")
    s1.add("t/0", 5)  # written other than by its rank's set(): "t" is read key by key here
    assert s1.get("t/0") == b"5"


def test_the_last_arrival_wakes_every_member_with_one_blocking_read_each(redis_url, job_id) -> None:
    world, keys = 5, job_keys(job_id)
    results: dict[int, tuple[int, list[str]]] = {}

    def member(i: int) -> None:
        client = CountingRedis.from_url(redis_url, socket_timeout=60, client_name=f"m-{job_id}-{i}")
        barrier = GenerationBarrier(client, keys)
        barrier.arrive(7, f"w{i}", world)
        n = barrier.wait(7, f"w{i}", world, 25.0)
        results[i] = (n, client.sent)

    threads = [threading.Thread(target=member, args=(i,)) for i in range(world - 1)]
    for t in threads:
        t.start()
    probe = redis.Redis.from_url(redis_url)
    names = {f"m-{job_id}-{i}" for i in range(world - 1)}
    wait_until(lambda: {c["name"] for c in probe.client_list() if c["name"] in names and c["cmd"] == "blpop"} == names,
               10, "every early member blocked in BLPOP")
    member(world - 1)  # the last one: completes the set, needs no blocking read
    for t in threads:
        t.join(10)
    assert {n for n, _ in results.values()} == {world}
    for i, (_, sent) in results.items():
        assert sent.count("blpop") == (0 if i == world - 1 else 1) and "scard" not in sent, sent
    assert probe.scard(keys.barrier(7)) == world
    for name in (keys.barrier(7), keys.barrier_done(7)):
        assert 0 < probe.pttl(name) <= RENDEZVOUS_TTL_S * 1000
    probe.close()


def test_a_wake_or_an_interruption_ends_a_wait_and_the_set_is_the_truth(r, redis_url, job_id) -> None:
    keys = job_keys(job_id)
    client = redis.Redis.from_url(redis_url, socket_timeout=60, client_name=f"waiter-{job_id}")
    barrier = GenerationBarrier(client, keys)
    assert barrier.arrive(3, "w0", 2) == 1
    assert not barrier.wake()  # nobody waits: nothing pushed
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(barrier.wait(3, "w0", 2, 25.0)))
    waiter.start()
    wait_until(lambda: any(c["name"] == f"waiter-{job_id}" and c["cmd"] == "blpop" for c in r.client_list()), 10,
               "the member blocked in BLPOP")
    assert not barrier.wake(newer=3)  # a table of the barrier's own generation: nothing to end
    assert barrier.wake(newer=4)  # the watcher saw a newer table
    waiter.join(20)
    assert got == [1] and not waiter.is_alive()
    # an interruption already known: no blocking read at all
    assert barrier.wait(3, "w0", 2, 25.0, interrupted=lambda: True) == 1
    # a token lost (here: deleted) cannot strand a member: the wait's end reads the set
    other = GenerationBarrier(r, keys)
    assert other.arrive(3, "w1", 2) == 2
    r.delete(keys.barrier_done(3))
    assert barrier.wait(3, "w0", 2, 0.05) == 2
    client.close()
