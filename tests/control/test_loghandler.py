"""Worker log lines into the job's capped stream: shipped, capped, and never a problem for
the caller when Redis is gone."""

from __future__ import annotations

import logging
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shoal.events.keys import job_keys
from shoal.ops.embedded import free_port
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


def test_redis_down_drops_lines_and_never_blocks_or_raises(job_id) -> None:
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.2, socket_connect_timeout=0.2,
                       retry=Retry(NoBackoff(), 0))
    h = RedisLogHandler(dead, job_keys(job_id).logs, "w0", capacity=10)
    logger = logging.getLogger(f"test.dead.{job_id}")
    logger.propagate = False
    logger.addHandler(h)
    try:
        started = time.monotonic()
        for i in range(500):
            logger.error("step %d", i)
        assert time.monotonic() - started < 0.5  # emit only queues; the full queue drops
    finally:
        logger.removeHandler(h)
        h.close(timeout=1)
    # a batch may still be failing in flight
    wait_until(lambda: h.dropped >= 500, 5, lambda: f"all 500 lines dropped ({h.dropped} so far)")
    assert h.sent == 0 and h.dropped == 500
