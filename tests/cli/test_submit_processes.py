"""``shoal submit`` -> RQ -> ``shoal agent --queue`` with real processes and a real Redis:
a job trained to completion, a graceful stop, logs, purge, metrics and bad input."""

from __future__ import annotations

import re
import signal
import urllib.request

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from shoal.coordinator.launcher import enqueue_units
from shoal.events.keys import COORDINATORS, JOBS, job_keys, job_of_launch_unit
from shoal.ops.embedded import free_port
from tests.helpers import ControlWatcher, server_ms, wait_until
from tests.helpers import run_cli as shoal

pytestmark = pytest.mark.slow


def units_of(queue, job_id: str) -> list[str]:
    return [i for i in queue.get_job_ids() if job_of_launch_unit(i) == job_id]


def write_spec(path, **fields) -> str:
    path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()))
    return str(path)


def test_invalid_spec_is_refused_before_anything_is_queued(r, cli_env, tmp_path, job_id, queue) -> None:
    bad = write_spec(tmp_path / "bad.yaml", name=job_id, entrypoint="simulate", min_workers=3, max_workers=2)
    res = shoal(cli_env, "submit", bad)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("shoal: ") and "min_workers" in res.stderr
    nested = write_spec(tmp_path / "typo.yaml", name=job_id, max_workerz=2)
    res = shoal(cli_env, "submit", nested)
    assert res.returncode == 2 and "max_workerz" in res.stderr and "Traceback" not in res.stderr
    res = shoal(cli_env, "submit", str(tmp_path / "missing.yaml"))
    assert res.returncode == 2 and res.stderr.startswith("shoal: cannot read job spec")
    assert not r.sismember(JOBS, job_id) and not r.exists(job_keys(job_id).spec)
    assert queue.count == 0 and units_of(queue, job_id) == []
    # an unreachable server: one line, exit 3, and the password in REDIS_URL is never printed
    good = write_spec(tmp_path / "good.yaml", name=job_id, entrypoint="simulate")
    res = shoal({**cli_env, "REDIS_URL": f"redis://user:s3cret-pw@127.0.0.1:{free_port()}/0"}, "submit", good)
    assert res.returncode == 3 and res.stderr.count("\n") == 1 and "s3cret-pw" not in res.stderr + res.stdout
    assert "user:***@" in res.stderr
    # bad input to the other new commands: one line, non-zero, nothing changed
    for args in (["stop", job_id], ["logs", job_id], ["stop", "bad{id}"], ["purge", "--state", "running"],
                 ["agent", job_id, "--queue"], ["coordinator", "--metrics-port", "70000"]):
        res = shoal(cli_env, *args)
        assert res.returncode != 0 and res.stderr.count("\n") == 1 and res.stderr.startswith("shoal: "), (args, res.stderr)


def test_a_unit_whose_job_failed_is_a_failed_rq_job_with_the_cause(r, cli_env, tmp_path, job_id, procs, queue) -> None:
    """Every worker dies before joining (a misspelt entrypoint, submitted with --no-validate):
    the job fails with that cause, and its launch unit ends in RQ's failed registry with the
    cause as its exception, not as a ``finished`` job (so ``rq info``, the failed registry and
    RQ's retries see it)."""
    from rq.registry import FailedJobRegistry

    procs.coordinator("coord")
    spec = write_spec(tmp_path / "job.yaml", name=job_id, entrypoint="shoal.examples.digits:buidl", max_steps=5,
                      min_workers=1, max_workers=1, max_restarts=0)
    assert shoal(cli_env, "submit", spec).returncode == 2  # refused: the entrypoint does not exist here either
    res = shoal(cli_env, "submit", spec, "--no-validate")
    assert res.returncode == 0, res.stderr
    [unit] = units_of(queue, job_id)
    agent = procs.start("agent", "agent", "--queue", "--burst", "--name", f"agent-{job_id}")
    agent.wait(90)
    job = Job.fetch(unit, connection=r, serializer=JSONSerializer)
    assert job.get_status() == "failed", agent.log_tail()
    assert unit in FailedJobRegistry(queue=queue).get_job_ids()
    info = job.latest_result().exc_string
    assert f"job {job_id} failed:" in info and "failed before joining" in info, info
    assert "buidl" in info
    assert job.get_meta(refresh=True)["state"] == "failed"


def test_submitted_digits_job_trains_to_completion_through_a_queue_agent(r, cli_env, tmp_path, job_id, procs, queue) -> None:
    port = free_port()
    coord = procs.coordinator("coord", "--metrics-port", str(port))
    spec = write_spec(tmp_path / "job.yaml", name=job_id, entrypoint="shoal.examples.digits:build", max_steps=5,
                      global_batch_size=64, min_workers=1, max_workers=1, heartbeat_interval=0.2, heartbeat_ttl=2.0)
    res = shoal(cli_env, "submit", spec, "--workers", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == job_id
    [unit] = units_of(queue, job_id)
    agent = procs.start("agent", "agent", "--queue", "--burst", "--name", f"agent-{job_id}")
    rc = agent.wait(90)
    assert rc == 0, agent.log_tail()

    job = Job.fetch(unit, connection=r, serializer=JSONSerializer)
    assert job.get_status() == "finished", agent.log_tail()
    result = job.return_value()
    assert result["state"] == "completed" and result["steps"] == 5, result
    assert result["summary"]["step"] == 5 and result["summary"]["digest"]
    assert result["agent_exit_code"] == 0 and result["generation"] >= 1
    meta = job.get_meta(refresh=True)
    assert meta["done"] is True and meta["step"] == 5 and meta["state"] == "completed"

    # the worker's log lines went to the job's log stream
    logs = shoal(cli_env, "logs", job_id)
    assert logs.returncode == 0 and re.search(r"\bw\d+\s+INFO\s+.*finished: ", logs.stdout), logs.stdout
    only = shoal(cli_env, "logs", job_id, "--worker", "nobody")
    assert only.returncode == 0 and only.stdout == ""

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert re.search(r'^shoal_jobs\{state="completed"\} [1-9]', text, re.M), text
    assert re.search(rf'^shoal_job_generation\{{job="{job_id}"\}} [1-9]', text, re.M)
    assert re.search(r"^shoal_events_handled_total [1-9]", text, re.M)
    assert coord.popen.poll() is None


def test_drained_agent_is_relaunched_then_stop_is_graceful_and_purge_removes_the_job(
        r, cli_env, tmp_path, job_id, procs, queue) -> None:
    watch = ControlWatcher(r, job_id)
    coord = procs.coordinator("coord", "--launch-interval", "0.3", "--launch-cooldown", "5")
    spec = write_spec(tmp_path / "sim.yaml", name=job_id, entrypoint="simulate", min_workers=1, max_workers=2,
                      global_batch_size=20, heartbeat_interval=0.2, heartbeat_ttl=1.0, max_steps=100000,
                      simulate_step_time=0.02)
    res = shoal(cli_env, "submit", spec, "--workers", "2")
    assert res.returncode == 0, res.stderr
    [first] = units_of(queue, job_id)
    procs.extra_env["SHOAL_LAUNCH_META_INTERVAL"] = "0.3"
    agent1 = procs.start("agent1", "agent", "--queue")
    watch.wait_for(lambda d: d.world_size == 2, 40)

    # progress in the RQ job's meta while it runs: step, generation, rate, ETA (max_steps is set)
    meta = wait_until(lambda: (m := Job.fetch(first, connection=r, serializer=JSONSerializer).get_meta(refresh=True))
                      .get("steps_per_s") and m, 15, "progress in the unit's meta")
    assert meta["step"] > 0 and meta["generation"] >= 1 and meta["world_size"] == 2 and meta["eta_s"] > 0
    assert meta["state"] == "running" and meta["workers"] == 2

    # SIGTERM to the queue agent drains its unit: workers leave, nobody fails, the unit ends
    agent1.signal(signal.SIGTERM)
    assert agent1.wait(30) == 0, agent1.log_tail()
    watch.wait_for(lambda d: d.job_state == "paused", 10)
    result = Job.fetch(first, connection=r, serializer=JSONSerializer).return_value()
    assert result["state"] in ("paused", "running") and result["agent_exit_code"] == 0, result
    assert all(rec["state"] == "Left" for rec in watch.workers().values()), watch.workers()

    # the coordinator's launcher sees a paused job with no unit queued or running: one new unit of 2
    [second] = wait_until(lambda: units_of(queue, job_id), 10, "a re-enqueued launch unit")
    assert second != first and Job.fetch(second, connection=r, serializer=JSONSerializer).args == [job_id, 2]
    agent2 = procs.start("agent2", "agent", "--queue", "--burst")
    watch.wait_for(lambda d: d.world_size == 2, 40)

    res = shoal(cli_env, "stop", job_id, "--wait", "10")
    assert res.returncode == 0 and "stop requested" in res.stdout, res.stderr
    assert agent2.wait(30) == 0, agent2.log_tail()
    result = Job.fetch(second, connection=r, serializer=JSONSerializer).return_value()
    assert result["state"] == "stopped" and result["reason"] == "stopped by operator"
    assert result["agent_exit_code"] == 0
    # graceful: workers exited by themselves (status 0), nobody was declared failed
    assert all(rec["state"] != "Failed" for rec in watch.workers().values())
    assert "died" not in agent2.log_tail(200)
    assert shoal(cli_env, "stop", job_id).stdout.startswith(f"job {job_id} is already stopped")
    # no launcher pass since the stop queued anything. Evidence that one ran: a decoy unit of the
    # stopped job, queued now, is dropped by the next pass, which logs how many it dropped
    assert units_of(queue, job_id) == []
    [decoy] = enqueue_units(queue, job_id, [1])
    drops = rf"job {re.escape(job_id)} is stopped: dropped (\d+) queued"
    dropped = wait_until(lambda: re.findall(drops, coord.log_path.read_text()), 10,
                         "a launcher pass dropping the stopped job's decoy unit")
    assert dropped == ["1"], coord.log_tail()  # the decoy alone
    assert units_of(queue, job_id) == [] and not r.exists(Job.key_for(decoy))
    # the launcher enqueued for this job once in all: the unit after the drain
    enqueued = re.findall(rf"job {re.escape(job_id)} \(\w+\) has .* enqueued", coord.log_path.read_text())
    assert len(enqueued) == 1, enqueued

    dry = shoal(cli_env, "purge", "--state", "completed,stopped")
    assert dry.returncode == 0 and job_id in dry.stdout and "dry run" in dry.stdout
    assert r.exists(job_keys(job_id).spec)
    done = shoal(cli_env, "purge", "--state", "stopped", "--yes")
    assert done.returncode == 0 and "purged" in done.stdout, done.stderr
    assert not r.sismember(JOBS, job_id)
    assert list(r.scan_iter(match=f"shoal:{{{job_id}}}:*")) == []
    purged_ms = server_ms(r)

    # the coordinator that led the job let go of it before its keys went and carries on: its
    # entry in the replica registry (written every lease refresh) moves past the purge
    def refreshed_since_purge() -> bool:
        assert coord.popen.poll() is None, coord.log_tail()
        entries = {k.decode(): v.decode() for k, v in r.hgetall(COORDINATORS).items()}
        return any(k.startswith("coord:") and int(v.split(":")[0]) > purged_ms for k, v in entries.items())

    wait_until(refreshed_since_purge, 10, "a lease refresh of the coordinator after the purge")
    assert coord.popen.poll() is None, coord.log_tail()
