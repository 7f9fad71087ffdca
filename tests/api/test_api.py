"""``shoal serve`` as a real process against the session's real Redis: every endpoint, the
token check (missing, wrong, right; read-only without one), bad specs (4xx with one line
naming the field, nothing written), 404 for an unknown job, 503 when Redis is unreachable,
and no secret (token, Redis password) in any response or log line."""

from __future__ import annotations

import json

import httpx
import pytest

from shoal.events.keys import JOBS, job_keys, job_of_launch_unit
from shoal.ops.embedded import free_port
from shoal.ops.localproc import LocalProcs
from tests.api.conftest import ApiServer, start_serve
from tests.helpers import ControlWatcher, wait_until

pytestmark = pytest.mark.slow

EVERY_PATH = ["/health", "/health/live", "/jobs", "/jobs/summaries", "/jobs/purge", "/jobs/{job_id}", "/jobs/{job_id}/summary",
              "/jobs/{job_id}/progress", "/jobs/{job_id}/logs", "/jobs/{job_id}/logs/stream", "/jobs/{job_id}/events",
              "/jobs/{job_id}/events/stream", "/jobs/{job_id}/stop"]


def job_keyspace(r, job_id: str) -> list[bytes]:
    return list(r.scan_iter(match=f"shoal:{{{job_id}}}:*"))


def one_line(resp: httpx.Response) -> str:
    """The response's detail, checked to be one line of JSON with no traceback."""
    body = resp.json()
    assert set(body) == {"detail"} or "detail" in body, body
    detail = body["detail"]
    assert isinstance(detail, str) and "\n" not in detail and "Traceback" not in detail, detail
    return detail


def sse_events(text: str) -> list[tuple[str, dict]]:
    """``(event, data)`` of every event in a text/event-stream body."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":"))
        if "event" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_read_only_without_a_token(read_only_api_server: ApiServer, r, job_id) -> None:
    api = read_only_api_server
    health = api.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["read_only"] is True
    assert "read-only: no API token configured" in api.log()
    paths = api.http.get("/openapi.json").json()["paths"]
    assert sorted(paths) == sorted(EVERY_PATH)
    for method, path, body in (("POST", "/jobs", {"spec": {"name": job_id, "entrypoint": "simulate"}}),
                               ("POST", f"/jobs/{job_id}/stop", None), ("DELETE", f"/jobs/{job_id}", None),
                               ("POST", "/jobs/purge", {"states": ["completed"]})):
        resp = api.http.request(method, path, json=body, headers={"Authorization": "Bearer " + "x" * 32})
        assert resp.status_code == 403, (method, path, resp.text)
        assert "read-only" in one_line(resp) and "SHOAL_API_TOKEN" in one_line(resp)
    assert job_keyspace(r, job_id) == [] and not r.sismember(JOBS, job_id)
    # reads work
    assert api.http.get("/jobs").status_code == 200
    assert api.http.get("/").status_code == 200 and "<canvas id=\"loss-chart\"" in api.http.get("/").text


def test_the_token_is_checked_and_never_shown(api_server: ApiServer, r, job_id) -> None:
    body = {"spec": {"name": job_id, "entrypoint": "simulate"}, "queue": False}
    for headers in ({}, api_server.auth("wrong-token-wrong-token"), {"Authorization": f"Basic {api_server.token}"},
                    {"Authorization": f"Bearer {api_server.token}x"}, {"Authorization": f"Bearer {api_server.token[:-1]}"}):
        resp = api_server.http.post("/jobs", json=body, headers=headers)
        assert resp.status_code == 401, (headers, resp.text)
        assert resp.headers["www-authenticate"].startswith("Bearer")
        one_line(resp)
        assert job_keyspace(r, job_id) == []
    resp = api_server.http.post("/jobs", json=body, headers=api_server.auth())
    assert resp.status_code == 201, resp.text
    assert resp.json() == {"job_id": job_id, "queued": False, "queue": None, "unit_ids": [], "workers_per_unit": []}
    assert r.sismember(JOBS, job_id) and r.exists(job_keys(job_id).spec)
    assert api_server.http.get("/health").json()["read_only"] is False
    # the token is in no response and in no log line (uvicorn's access log included)
    seen = [api_server.http.get(p).text for p in ("/jobs", f"/jobs/{job_id}", "/health", "/openapi.json")]
    assert not any(api_server.token in text for text in seen)
    assert '"POST /jobs HTTP/1.1" 201' in api_server.log() and api_server.token not in api_server.log()
    api_server.http.delete(f"/jobs/{job_id}", headers=api_server.auth())


BAD_SPECS = [
    ({"name": "J", "entrypoint": "simulate", "global_batch_size": 0}, "global_batch_size"),
    ({"name": "J", "entrypoint": "simulate", "max_workerz": 2}, "max_workerz"),
    ({"name": "J", "entrypoint": "simulate", "min_workers": 3, "max_workers": 2}, "min_workers"),
    ({"name": "J", "entrypoint": "no_such_module_here:build"}, "no_such_module_here"),
    ({"name": "J", "entrypoint": "shoal.examples.digits"}, "entrypoint"),
    ({"name": "J", "entrypoint": "simulate", "working_dir": "/tmp"}, "working_dir"),
    ({"name": "J", "entrypoint": "simulate", "checkpoint_uri": "s3://key:secret@bucket/x"}, "checkpoint_uri"),
    ({"name": "J", "entrypoint": "simulate", "checkpoint_uri": "s3://bucket/x"}, "checkpoint_uri"),
    ({"name": "J", "entrypoint": "simulate", "heartbeat_ttl": "soon"}, "heartbeat_ttl"),
    ({"name": "bad{name}", "entrypoint": "simulate"}, "name"),
]


def test_bad_specs_are_refused_with_one_line_and_nothing_is_written(api_server: ApiServer, r, job_id, queue) -> None:
    queued = queue.count
    for spec, field in BAD_SPECS:
        spec = {**spec, "name": job_id} if spec["name"] == "J" else spec
        resp = api_server.http.post("/jobs", json={"spec": spec, "workers": 1}, headers=api_server.auth())
        assert resp.status_code == 422, (spec, resp.text)
        detail = one_line(resp)
        assert field in detail, (field, detail)
        assert "secret" not in detail
        assert job_keyspace(r, job_id) == [] and not r.sismember(JOBS, job_id), spec
    for body in ({"spec": {"name": job_id, "entrypoint": "simulate"}, "workers": 0},
                 {"spec": {"name": job_id, "entrypoint": "simulate"}, "workerz": 2},
                 {"spec": [1, 2]}, {}):
        resp = api_server.http.post("/jobs", json=body, headers=api_server.auth())
        assert resp.status_code == 422, (body, resp.text)
        one_line(resp)
    resp = api_server.http.post("/jobs", content=b"{not json", headers={**api_server.auth(), "Content-Type": "application/json"})
    assert resp.status_code == 422 and one_line(resp)
    resp = api_server.http.post("/jobs", content=b"x" * (2 << 20), headers={**api_server.auth(), "Content-Type": "application/json"})
    assert resp.status_code == 413
    assert job_keyspace(r, job_id) == [] and not r.sismember(JOBS, job_id) and queue.count == queued
    # a name that is taken: 409, and the existing job is untouched
    good = {"spec": {"name": job_id, "entrypoint": "simulate", "max_workers": 3}, "workers": 2}
    first = api_server.http.post("/jobs", json=good, headers=api_server.auth())
    assert first.status_code == 201, first.text
    assert first.json()["workers_per_unit"] == [2, 1] and len(first.json()["unit_ids"]) == 2
    assert sorted(i for i in queue.get_job_ids() if job_of_launch_unit(i) == job_id) == sorted(first.json()["unit_ids"])
    both = api_server.http.post("/jobs", json={**good, "units": 2}, headers=api_server.auth())
    assert both.status_code == 422 and "not both" in one_line(both)
    spec_before = r.get(job_keys(job_id).spec)
    again = api_server.http.post("/jobs", json={"spec": {"name": job_id, "entrypoint": "simulate", "epochs": 9}},
                                 headers=api_server.auth())
    assert again.status_code == 409 and "already exists" in one_line(again)
    assert r.get(job_keys(job_id).spec) == spec_before
    # deleting it drops its queued launch units too
    assert api_server.http.delete(f"/jobs/{job_id}", headers=api_server.auth()).status_code == 200
    assert [i for i in queue.get_job_ids() if job_of_launch_unit(i) == job_id] == []
    assert job_keyspace(r, job_id) == []
    # or a number of launch units: max_workers spread over them
    by_units = api_server.http.post("/jobs", json={"spec": {"name": job_id, "entrypoint": "simulate", "max_workers": 5},
                                                   "units": 2}, headers=api_server.auth())
    assert by_units.status_code == 201 and by_units.json()["workers_per_unit"] == [3, 2], by_units.text
    assert api_server.http.delete(f"/jobs/{job_id}", headers=api_server.auth()).status_code == 200


def test_params_sent_over_the_api_are_checked_against_build_and_shown(api_server: ApiServer, r, job_id) -> None:
    """Issue 37: ``params`` in a POSTed spec are the entrypoint's keyword arguments; a wrong one
    is refused (422, one line naming it, nothing written), a right one is stored and shown."""
    spec = {"name": job_id, "entrypoint": "tests.entrypoints:steady_digits", "params": {"width": 8, "pace": 0.01}}
    bad = api_server.http.post("/jobs", json={"spec": {**spec, "params": {"width": 8, "widht": 8}}, "queue": False},
                               headers=api_server.auth())
    assert bad.status_code == 422 and "unexpected argument 'widht' in params" in one_line(bad)
    assert job_keyspace(r, job_id) == []
    ok = api_server.http.post("/jobs", json={"spec": spec, "queue": False}, headers=api_server.auth())
    assert ok.status_code == 201, ok.text
    got = api_server.http.get(f"/jobs/{job_id}").json()
    assert got["params"] == {"width": 8, "pace": 0.01} and got["spec"]["params"] == {"width": 8, "pace": 0.01}
    assert api_server.http.delete(f"/jobs/{job_id}", headers=api_server.auth()).status_code == 200


def test_unknown_jobs_are_404(api_server: ApiServer) -> None:
    for method, path in (("GET", "/jobs/nope"), ("GET", "/jobs/nope/summary"), ("GET", "/jobs/nope/progress"),
                         ("GET", "/jobs/nope/logs"), ("GET", "/jobs/nope/logs/stream"), ("GET", "/jobs/nope/events"),
                         ("GET", "/jobs/nope/events/stream"), ("POST", "/jobs/nope/stop"), ("DELETE", "/jobs/nope")):
        resp = api_server.http.request(method, path, headers=api_server.auth())
        assert resp.status_code == 404, (method, path, resp.text)
        assert one_line(resp) == "no job 'nope' in this Redis"
    resp = api_server.http.get("/jobs/bad{id}")
    assert resp.status_code == 422 and "invalid job id" in one_line(resp)
    resp = api_server.http.get("/jobs/nope/logs", params={"after": "yesterday"})
    assert resp.status_code in (404, 422)


def test_every_endpoint_on_a_running_job(api_server: ApiServer, r, procs, job_id) -> None:
    """A simulated job registered through the API, run by a real coordinator and two real
    workers: the lists, status, summary, chart data, log lines, decisions (also as event
    streams), stop, purge and delete."""
    spec = {"name": job_id, "entrypoint": "simulate", "min_workers": 1, "max_workers": 2, "max_steps": 1_000_000,
            "heartbeat_interval": 0.2, "heartbeat_ttl": 1.5}
    assert api_server.http.post("/jobs", json={"spec": spec, "queue": False}, headers=api_server.auth()).status_code == 201
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    procs.worker(job_id, "p0")
    procs.worker(job_id, "p1")
    watch.wait_for(lambda d: d.world_size == 2, 60)

    status = wait_until(lambda: (s := api_server.http.get(f"/jobs/{job_id}").json())["state"] == "running"
                        and sum(w["state"] == "Active" for w in s["workers"]) == 2 and s, 30, "two Active workers")
    assert status["spec"]["max_workers"] == 2 and status["leader"] == "coord" and status["world_size"] == 2
    w = status["workers"][0]
    for key in ("worker_id", "state", "rank", "step", "heartbeat_age_ms", "straggler", "digest", "host", "pid"):
        assert key in w, key
    listed = {j["job_id"]: j for j in api_server.http.get("/jobs").json()["jobs"]}
    assert listed[job_id]["state"] == "running" and listed[job_id]["active"] == 2
    summary = api_server.http.get(f"/jobs/{job_id}/summary").json()
    assert summary["state"] == "running" and summary["generation"] >= 1
    assert job_id in {s["job_id"] for s in api_server.http.get("/jobs/summaries").json()["jobs"]}
    chart = api_server.http.get(f"/jobs/{job_id}/progress").json()
    assert [m["kind"] for m in chart["marks"]][:1] == ["start"] and chart["more"] is False
    decisions = api_server.http.get(f"/jobs/{job_id}/events").json()
    assert any("world size 2" in d["reason"] for d in decisions["decisions"])
    page = api_server.http.get(f"/jobs/{job_id}/events", params={"after": decisions["decisions"][0]["id"], "limit": 1})
    assert page.json()["decisions"] == decisions["decisions"][1:2]
    lines = wait_until(lambda: api_server.http.get(f"/jobs/{job_id}/logs").json()["lines"], 30, "log lines")
    assert {"id", "ts", "worker", "level", "msg"} <= set(lines[0])
    only = api_server.http.get(f"/jobs/{job_id}/logs", params={"worker": lines[0]["worker"], "tail": 1}).json()["lines"]
    assert len(only) == 1 and only[0]["worker"] == lines[0]["worker"]

    stop = api_server.http.post(f"/jobs/{job_id}/stop", json={"reason": "enough from the API test"}, headers=api_server.auth())
    assert stop.status_code == 202 and stop.json()["was"] == "running" and stop.json()["requested"] is True
    watch.wait_for(lambda d: d.job_state == "stopped", 30)
    again = api_server.http.post(f"/jobs/{job_id}/stop", headers=api_server.auth())
    assert again.status_code == 200 and again.json()["requested"] is False and again.json()["was"] == "stopped"
    assert api_server.http.get(f"/jobs/{job_id}").json()["reason"].endswith("enough from the API test")
    # the event stream of an ended job: its decisions, then 'end'
    stream = api_server.http.get(f"/jobs/{job_id}/events/stream", timeout=30)
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = sse_events(stream.text)
    assert events[-1] == ("end", {"job_id": job_id, "state": "stopped"})
    assert [d for k, d in events if k == "decision"][-1]["job_state"] == "stopped"
    # resuming after the next-to-last decision sends only the last one
    resumed = sse_events(api_server.http.get(f"/jobs/{job_id}/events/stream",
                                             headers={"Last-Event-ID": events[-3][1]["id"]}).text)
    assert resumed == events[-2:]

    listed = api_server.http.post("/jobs/purge", json={"states": ["stopped"], "dry_run": True}, headers=api_server.auth())
    assert listed.status_code == 200 and listed.json()["jobs"][job_id] == "stopped" and r.exists(job_keys(job_id).spec)
    bad = api_server.http.post("/jobs/purge", json={"states": ["running"]}, headers=api_server.auth())
    assert bad.status_code == 422 and "finished states only" in one_line(bad)
    for p in procs.procs:
        if p.role == "worker":
            p.wait(30)
    purged = api_server.http.post("/jobs/purge", json={"states": ["stopped"]}, headers=api_server.auth())
    assert purged.status_code == 200 and job_id in purged.json()["jobs"] and purged.json()["deleted_keys"] > 0
    assert job_keyspace(r, job_id) == [] and api_server.http.get(f"/jobs/{job_id}").status_code == 404
    assert api_server.http.delete(f"/jobs/{job_id}", headers=api_server.auth()).status_code == 404


def test_an_unreachable_redis_is_503_and_its_password_is_never_shown(tmp_path) -> None:
    url = f"redis://user:pa55-w0rd-x@127.0.0.1:{free_port()}/0"  # nothing listens there
    with LocalProcs(url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
        proc, base = start_serve(procs, "serve-down")
        http = httpx.Client(base_url=base, timeout=30)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert http.get("/health/live").status_code == 200  # liveness does not ask Redis
        assert health.json()["redis"].startswith("Redis unavailable: ")
        for path in ("/jobs", "/jobs/x", "/jobs/x/logs", "/jobs/x/events/stream"):
            resp = http.get(path)
            assert resp.status_code == 503, (path, resp.text)
            assert one_line(resp).startswith("Redis unavailable: ")
            assert "pa55-w0rd-x" not in resp.text
        assert http.get("/").status_code == 200  # the dashboard still loads, and says so
        http.close()
    log = proc.log_path.read_text()
    assert "pa55-w0rd-x" not in log and "user:***@" in log and "does not answer yet" in log
