"""The coordinator's Prometheus endpoint, scraped over HTTP."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shoal.coordinator.loop import Coordinator
from shoal.events.keys import job_keys
from shoal.ops.embedded import free_port
from shoal.core.errors import ConfigError
from shoal.core.registry import create_job, delete_job
from shoal.core.jobspec import JobSpec
from shoal.ops.metrics import MetricsServer


def scrape(server: MetricsServer, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{server.host}:{server.port}{path}", timeout=5) as resp:
        return resp.headers["Content-Type"], resp.read().decode()


def value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    assert m, f"{series} not in scrape:\n{text}"
    return float(m.group(1))


def test_scrape_reports_jobs_workers_generations_and_replica_counters(r, job_id) -> None:
    create_job(r, JobSpec(name=job_id, entrypoint="simulate"))
    keys = job_keys(job_id)
    try:
        before = {s: 0.0 for s in ("completed", "Active", "Failed")}
        coord = Coordinator(r, instance_id="metrics-test")
        with MetricsServer(r, coord, port=0) as server:
            assert server.host == "127.0.0.1"
            _ctype, text = scrape(server)
            before = {"completed": value(text, 'shoal_jobs{state="completed"}'),
                      "Active": value(text, 'shoal_workers{state="Active"}'),
                      "Failed": value(text, 'shoal_workers{state="Failed"}')}
            # what a coordinator would have written (the real writes are fenced)
            r.hset(keys.state, mapping={"state": "completed", "generation": "3"})
            r.hset(keys.workers, mapping={"w0": json.dumps({"worker_id": "w0", "state": "Active"}),
                                          "w1": json.dumps({"worker_id": "w1", "state": "Failed"})})
            coord.stats.events_handled, coord.stats.dead_lettered, coord.stats.takeovers = 7, 2, 1
            coord.stats.generations = 3
            coord.stats.detection_latency_ms += [80, 300, 1500]
            ctype, text = scrape(server)
            assert ctype.startswith("text/plain; version=0.0.4")
            assert value(text, 'shoal_jobs{state="completed"}') == before["completed"] + 1
            assert value(text, 'shoal_workers{state="Active"}') == before["Active"] + 1
            assert value(text, 'shoal_workers{state="Failed"}') == before["Failed"] + 1
            assert value(text, f'shoal_job_generation{{job="{job_id}"}}') == 3
            assert value(text, "shoal_events_handled_total") == 7
            assert value(text, "shoal_events_dead_lettered_total") == 2
            assert value(text, "shoal_takeovers_total") == 1
            assert value(text, "shoal_generations_total") == 3
            assert value(text, "shoal_redis_up") == 1
            h = "shoal_failure_detection_latency_seconds"
            assert value(text, f'{h}_bucket{{le="0.1"}}') == 1
            assert value(text, f'{h}_bucket{{le="0.5"}}') == 2
            assert value(text, f'{h}_bucket{{le="+Inf"}}') == 3 and value(text, f"{h}_count") == 3
            assert value(text, f"{h}_sum") == pytest.approx(1.88)
            # counters only grow between scrapes; nothing is counted twice
            coord.stats.detection_latency_ms.append(20_000)
            _ctype, text = scrape(server)
            assert value(text, f"{h}_count") == 4 and value(text, f'{h}_bucket{{le="10.0"}}') == 3
            # training series of the job, from its Active members' heartbeats and records
            from shoal.events.models import Heartbeat, Member, ShardTable

            r.hset(keys.workers, "w0", json.dumps({"worker_id": "w0", "state": "Active", "restarts": 2}))
            r.set(keys.heartbeat("w0"), Heartbeat(worker_id="w0", step=41, loss=0.5, step_time=0.25, compute_time=0.2,
                                                          input_wait_time=0.01).model_dump_json())
            r.set(keys.shard, ShardTable(job_id=job_id, generation=3, world_size=1, strategy="contiguous",
                                         num_samples=64, members=[Member(worker_id="w0", rank=0, ranges=[(0, 64, 1)])]
                                         ).model_dump_json())
            r.xadd(keys.failures, {"worker": "w1", "reason": "x"})
            # removals by cause come from the records' typed state and cause, never a reason
            r.hset(keys.workers, mapping={
                "w1": json.dumps({"worker_id": "w1", "state": "Failed", "cause": "exited", "reason": "w1 left"}),
                "w2": json.dumps({"worker_id": "w2", "state": "Failed", "cause": "heartbeat_timeout"}),
                "w3": json.dumps({"worker_id": "w3", "state": "Failed", "cause": "exited"}),
                "w4": json.dumps({"worker_id": "w4", "state": "Left", "reason": "w4 failed"})})
            _ctype, text = scrape(server)
            assert value(text, f'shoal_job_step{{job="{job_id}"}}') == 41
            assert value(text, f'shoal_job_loss{{job="{job_id}"}}') == 0.5
            assert value(text, f'shoal_job_steps_per_second{{job="{job_id}"}}') == 4
            assert value(text, f'shoal_job_world_size{{job="{job_id}"}}') == 1
            assert value(text, f'shoal_job_step_part_seconds{{job="{job_id}",part="compute"}}') == 0.2
            assert value(text, f'shoal_job_step_part_seconds{{job="{job_id}",part="input_wait"}}') == 0.01
            assert f'part="exposed_comm"' not in text  # not reported by this (older) worker
            assert value(text, f'shoal_job_worker_restarts_total{{job="{job_id}"}}') == 2
            assert value(text, f'shoal_job_failures_total{{job="{job_id}"}}') == 1
            removed = "shoal_job_workers_removed"
            assert value(text, f'{removed}{{job="{job_id}",cause="exited"}}') == 2
            assert value(text, f'{removed}{{job="{job_id}",cause="heartbeat_timeout"}}') == 1
            assert value(text, f'{removed}{{job="{job_id}",cause="left"}}') == 1
            assert "# TYPE shoal_job_worker_restarts_total counter" in text
            with pytest.raises(urllib.error.HTTPError) as err:
                scrape(server, "/other")
            assert err.value.code == 404
    finally:
        delete_job(r, job_id)


def test_scrape_answers_when_redis_is_down() -> None:
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.5, socket_connect_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
    with MetricsServer(dead, None, port=0) as server:
        _ctype, text = scrape(server)
    assert value(text, "shoal_redis_up") == 0 and "shoal_jobs{" not in text


def test_port_in_use_is_a_one_line_config_error(r) -> None:
    with MetricsServer(r, None, port=0) as server:
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{server.port}"):
            MetricsServer(r, None, port=server.port)
