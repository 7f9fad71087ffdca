"""Worker log lines into the job's capped stream: shipped, capped, and never a problem for
the caller when Redis is gone."""

from __future__ import annotations

import logging
import socket
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shoal.events.keys import job_keys
from shoal.worker.loghandler import RedisLogHandler, redis_logging
from tests.helpers import wait_until


def _entries(r, job_id):
    return [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(job_keys(job_id).logs)]


def test_lines_reach_the_stream_with_worker_level_and_time(r, job_id) -> None:
    logger = logging.getLogger(f"test.{job_id}")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    who = {"id": None}
    with redis_logging(r, job_id, lambda: who["id"], logger=logger):
        logger.info("before join")
        who["id"] = "w7"
        logger.warning("joined as %s", "w7")
        logger.debug("below INFO: not shipped")
    got = _entries(r, job_id)
    assert [(e["worker"], e["level"]) for e in got] == [("-", "INFO"), ("w7", "WARNING")]
    assert got[1]["msg"].endswith("joined as w7") and abs(float(got[1]["ts"]) - time.time()) < 60
    assert not logger.handlers


def test_stream_is_capped_approximately(r, job_id) -> None:
    h = RedisLogHandler(r, job_keys(job_id).logs, "w0", maxlen=100, capacity=5000)
    logger = logging.getLogger(f"test.cap.{job_id}")
    logger.propagate = False
    logger.addHandler(h)
    try:
        for i in range(2000):
            logger.error("line %d", i)
    finally:
        logger.removeHandler(h)
        h.close(timeout=10)
    assert h.sent == 2000 and h.dropped == 0
    assert 100 <= r.xlen(job_keys(job_id).logs) < 400  # MAXLEN ~ trims whole nodes


#: How long each Redis command of the silent server below hangs (its socket timeout).
HANG_S = 3.0


def test_redis_down_drops_lines_and_never_blocks_or_raises(job_id) -> None:
    # Redis as a partition shows it: the connection opens (the kernel completes the
    # handshake), nothing ever answers, every command hangs for HANG_S. An emit that waited
    # for Redis would take HANG_S for its first line alone; 500 emits that only queue take
    # milliseconds even on a loaded 2-core box, so the bound below has a margin of ~1000x
    # and still fails a blocking emit on its first line. (A refused port, as this test used,
    # fails in microseconds: it could not tell a blocking emit from a queueing one.)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        dead = redis.Redis(host="127.0.0.1", port=silent.getsockname()[1], socket_timeout=HANG_S,
                           socket_connect_timeout=HANG_S, retry=Retry(NoBackoff(), 0))
        h = RedisLogHandler(dead, job_keys(job_id).logs, "w0", capacity=10)
        logger = logging.getLogger(f"test.dead.{job_id}")
        logger.propagate = False
        logger.addHandler(h)
        try:
            started = time.monotonic()
            for i in range(500):
                logger.error("step %d", i)
                assert time.monotonic() - started < HANG_S, f"emit {i} waited for Redis"
        finally:
            logger.removeHandler(h)
            h.close(timeout=1)
        # the batch in flight fails once its command has hung for HANG_S
        wait_until(lambda: h.dropped >= 500, HANG_S + 5, lambda: f"all 500 lines dropped ({h.dropped} so far)")
    assert h.sent == 0 and h.dropped == 500
