"""The API's Server-Sent Event streams while a real job trains (a real ``shoal serve``, a real
coordinator, two real training workers): log lines and coordinator decisions arrive as they
are written, not after the job, and each stream ends with the job's final state."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.api.conftest import ApiServer
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow


class Follower(threading.Thread):
    """Reads one event stream in the background: ``(arrival time, event, data)`` per event."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.events: list[tuple[float, str, dict]] = []
        self.opened = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("GET", self.url, timeout=httpx.Timeout(10, read=60)) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                self.opened.set()
                fields: dict[str, str] = {}
                for line in resp.iter_lines():
                    if line:
                        name, _, value = line.partition(": ")
                        fields[name] = value
                    elif "event" in fields:
                        self.events.append((time.monotonic(), fields["event"], json.loads(fields["data"])))
                        fields = {}
                    else:
                        fields = {}
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
            self.opened.set()

    def kinds(self, kind: str, before: float = float("inf")) -> list[dict]:
        return [d for t, k, d in self.events if k == kind and t < before]


def test_log_lines_and_decisions_stream_while_a_job_trains(api_server: ApiServer, r, procs, job_id, monkeypatch) -> None:
    monkeypatch.setenv("SHOAL_TEST_STEP_DELAY", "0.05")
    spec = {"name": job_id, "entrypoint": "tests.entrypoints:slow_digits", "min_workers": 2, "max_workers": 2,
            "max_steps": 60, "heartbeat_interval": 0.2, "heartbeat_ttl": 1.5}
    assert api_server.http.post("/jobs", json={"spec": spec, "queue": False}, headers=api_server.auth()).status_code == 201
    logs = Follower(f"{api_server.url}/jobs/{job_id}/logs/stream")
    decisions = Follower(f"{api_server.url}/jobs/{job_id}/events/stream")
    for f in (logs, decisions):
        f.start()
        assert f.opened.wait(30) and f.error is None, f.error
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    procs.worker(job_id, "p0")
    procs.worker(job_id, "p1")
    formed = watch.wait_for(lambda d: d.world_size == 2, 90)
    # the decision that formed the group reaches the stream while the job trains
    wait_until(lambda: any(d["reason"] == formed.reason for d in decisions.kinds("decision")), 10,
               "the generation's decision on the event stream")
    watch.wait_for(lambda d: d.job_state == "completed", 120)
    done = time.monotonic()
    for f in (logs, decisions):
        f.join(30)
        assert not f.is_alive() and f.error is None, f.error
    live_lines = logs.kinds("log", before=done)
    assert {line["worker"] for line in live_lines} >= {"w0", "w1"}, live_lines[-5:]
    assert any("generation" in line["msg"] for line in live_lines)
    assert all(line["id"] and line["ts"] > 0 for line in live_lines)
    live = decisions.kinds("decision", before=done)
    assert any("world size 2" in d["reason"] and d["job_state"] == "running" for d in live)
    assert decisions.kinds("decision")[-1]["job_state"] == "completed"
    assert decisions.events[-1][1:] == ("end", {"job_id": job_id, "state": "completed"})
    assert logs.events[-1][1:] == ("end", {"job_id": job_id, "state": "completed"})
    # the chart data of the finished job: its committed steps and its start and end marks
    chart = api_server.http.get(f"/jobs/{job_id}/progress").json()
    assert chart["points"]["step"] and 1 <= chart["points"]["step"][0] < max(chart["points"]["step"]) <= 60  # sampled
    assert [m["kind"] for m in chart["marks"]][0] == "start" and chart["marks"][-1]["kind"] == "end"
    more = api_server.http.get(f"/jobs/{job_id}/progress", params={"after": chart["last_id"]}).json()
    assert more["points"]["step"] == [] and more["last_id"] == chart["last_id"]
    assert api_server.http.get(f"/jobs/{job_id}/summary").json()["steps"] == 60
