"""Malformed work on the ``shoal-launch`` RQ queue, enqueued with RQ's own API, served by a
real ``shoal agent --queue --burst`` process: every bad unit ends as a failed RQ job whose
failure reason is one line, nothing it names is run, the agent keeps serving, and the valid
launch units queued before and after the bad ones train their jobs to completion."""

from __future__ import annotations

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from shoal.coordinator.launcher import LAUNCH_FUNC, NO_TIMEOUT
from shoal.ops.launch import LaunchRefused, unit_args
from shoal.ops.localproc import LocalProcs
from shoal.ops.submit import submit
from tests.helpers import job_spec


#: a short simulated job on one worker (job_spec: over the tests' common defaults)
ONE_WORKER_JOB = dict(entrypoint="simulate", min_workers=1, max_workers=1, global_batch_size=4, heartbeat_ttl=1.0,
                      simulate_step_time=0.02, max_steps=20)


@pytest.mark.slow
def test_bad_launch_units_fail_with_one_line_and_valid_units_still_run(r, redis_url, tmp_path, job_id, queue) -> None:
    first, last = f"{job_id}-a", f"{job_id}-b"
    pwned = tmp_path / "pwned"
    valid = [submit(r, job_spec(first, ONE_WORKER_JOB)).unit_ids[0]]
    bad = {  # name -> (function, args, kwargs, what the one-line reason says)
        "unknown job": (LAUNCH_FUNC, [f"{job_id}-nope", 1], {}, f"job '{job_id}-nope' does not exist"),
        "job id not a string": (LAUNCH_FUNC, [123, 1], {}, "job id must be 1-64 letters, digits, '_', '.', '-', got 123"),
        "job id not key-safe": (LAUNCH_FUNC, ["a}:b", 1], {}, "job id must be"),
        "workers a string": (LAUNCH_FUNC, [first, "2"], {}, "workers must be a positive integer, got '2'"),
        "workers zero": (LAUNCH_FUNC, [first, 0], {}, "workers must be a positive integer, got 0"),
        "workers a bool": (LAUNCH_FUNC, [first, True], {}, "workers must be a positive integer, got True"),
        "more workers than the job takes": (LAUNCH_FUNC, [first, 1000], {}, "workers 1000 exceeds job"),
        "missing argument": (LAUNCH_FUNC, [first], {}, "arguments are [job_id, workers]"),
        "extra keyword": (LAUNCH_FUNC, [first, 1], {"meta_interval": "x"}, "takes no keyword arguments"),
        "foreign function": ("os.makedirs", [str(pwned)], {}, "'os.makedirs' is not a launch unit"),
        "no such function": ("no_such_module.fn", [], {}, "'no_such_module.fn' is not a launch unit"),
    }
    ids = {}
    for name, (func, args, kwargs, _why) in bad.items():
        ids[name] = queue.enqueue_call(func, args=args, kwargs=kwargs, timeout=NO_TIMEOUT).id
    # a payload RQ cannot decode (written under RQ's key by hand, as a broken client would)
    corrupt = queue.enqueue_call(LAUNCH_FUNC, args=[first, 1], timeout=NO_TIMEOUT).id
    r.hset(f"rq:job:{corrupt}", "data", b"\x00not json")
    ids["corrupt payload"], bad["corrupt payload"] = corrupt, (None, None, None, "the payload is not an RQ JSON job")
    valid.append(submit(r, job_spec(last, ONE_WORKER_JOB)).unit_ids[0])

    with LocalProcs(redis_url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
        coord = procs.coordinator("coord", "--no-launcher")
        agent = procs.start("agent", "agent", "--queue", "--burst", "--name", f"agent-{job_id}")
        rc = agent.wait(120)
        log = agent.log_tail(10_000)
        assert rc == 0, log
        assert coord.popen.poll() is None, coord.log_tail()

    assert "Traceback" not in log
    assert not pwned.exists()  # the foreign function never ran
    for name, rq_id in ids.items():
        job = Job.fetch(rq_id, connection=r, serializer=JSONSerializer)
        assert job.get_status() == "failed", (name, job.get_status())
        reason = job.latest_result().exc_string
        assert "\n" not in reason.strip() and "Traceback" not in reason, (name, reason)
        assert bad[name][3] in reason, (name, reason)
        assert f"launch unit {rq_id} failed: {reason}" in log, name
    for rq_id, name in zip(valid, (first, last)):
        job = Job.fetch(rq_id, connection=r, serializer=JSONSerializer)
        assert job.get_status() == "finished", (name, job.get_status(), log)
        result = job.return_value()
        assert result["state"] == "completed" and result["steps"] == 20 and result["agent_exit_code"] == 0, result
    assert queue.count == 0


@pytest.mark.parametrize("func, args, kwargs", [
    ("shoal.launch.run_launch ", ["j", 1], {}),
    (LAUNCH_FUNC, ("j", 1, 2), {}),
    (LAUNCH_FUNC, "j1", {}),
    (LAUNCH_FUNC, None, {}),
    (LAUNCH_FUNC, [["j"], 1], {}),
    (LAUNCH_FUNC, ["", 1], {}),
    (LAUNCH_FUNC, ["j", 1.0], {}),
    (LAUNCH_FUNC, ["j", -1], {}),
    (None, ["j", 1], {}),
])
def test_unit_args_refuses_anything_but_a_job_id_and_a_count(func, args, kwargs) -> None:
    with pytest.raises(LaunchRefused) as info:
        unit_args(func, args, kwargs)
    assert "\n" not in str(info.value) and info.value.exit_code == 2
    assert unit_args(LAUNCH_FUNC, ["j-1.x_y", 3], {}) == ("j-1.x_y", 3)
    assert unit_args(LAUNCH_FUNC, ("j", 1), None) == ("j", 1)
