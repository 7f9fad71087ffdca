"""The cross-process contracts defined once: environment variables (``events/envvars.py``)
and worker exit codes (``events/exits.py``)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from shoal.events import envvars
from shoal.events.exits import Restart, WorkerExit


def test_every_variable_is_named_documented_and_registered() -> None:
    declared = {v for v in vars(envvars).values() if isinstance(v, envvars.EnvVar)}
    assert set(envvars.ALL.values()) == declared and len(declared) >= 28
    for name, var in envvars.ALL.items():
        assert name == var and name.startswith("SHOAL_") and var.meaning, name


def test_a_variable_reads_its_value_or_its_default() -> None:
    assert envvars.REDIS_WAIT_MS.get({}) == "500" and envvars.REDIS_WAIT_MS.get({"SHOAL_REDIS_WAIT_MS": ""}) == "500"
    assert envvars.REDIS_WAIT_MS.get({"SHOAL_REDIS_WAIT_MS": "20"}) == "20"
    assert envvars.LEDGER_DIR.get({}) == ""  # no default: unset


def test_a_variable_is_its_name_in_an_environment() -> None:
    env = {**os.environ, envvars.FAULTS: "w1@3:mid_step:kill"}
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['SHOAL_FAULTS'])"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "w1@3:mid_step:kill"
    back = pickle.loads(pickle.dumps(envvars.FAULTS))
    assert back == "SHOAL_FAULTS" and type(back) is str


@pytest.mark.parametrize(("code", "member", "restart"), [
    (0, WorkerExit.OK, Restart.NEVER),
    (1, WorkerExit.FAILED, Restart.BACKOFF),
    (2, WorkerExit.ENTRYPOINT_ERROR, Restart.BACKOFF),
    (4, WorkerExit.JOIN_REJECTED, Restart.NEVER),
    (5, WorkerExit.JOIN_TIMEOUT, Restart.BACKOFF),
    (75, WorkerExit.RESTART, Restart.AT_ONCE),
    (76, WorkerExit.ORPHANED, Restart.BACKOFF),
    (77, WorkerExit.STOPPED_IN_OUTAGE, Restart.NEVER),
])
def test_each_exit_code_has_one_meaning(code: int, member: WorkerExit, restart: Restart) -> None:
    assert WorkerExit.parse(code) is member and member == code and member.restart is restart
    assert f"exit code {member}" == f"exit code {code}"  # messages show the number


def test_other_codes_are_crashes() -> None:
    assert WorkerExit.parse(3) is None and WorkerExit.parse(-9) is None and WorkerExit.parse(None) is None


def test_the_errors_exit_with_their_codes() -> None:
    from shoal.worker.errors import EntrypointError, ReplicaGroupLost
    from shoal.worker.membership import JoinRejected, JoinTimeout

    assert (EntrypointError.exit_code, ReplicaGroupLost.exit_code, JoinRejected.exit_code, JoinTimeout.exit_code) == (
        WorkerExit.ENTRYPOINT_ERROR, WorkerExit.RESTART, WorkerExit.JOIN_REJECTED, WorkerExit.JOIN_TIMEOUT)


def test_a_client_of_replicas_says_so_by_its_type(monkeypatch) -> None:
    import redis

    from shoal.core.connection import ReplicatedRedis, replicas_to_wait, without_retries

    monkeypatch.delenv(envvars.REDIS_WAIT_REPLICAS, raising=False)
    plain, two = redis.Redis(), ReplicatedRedis(replicas=2)
    assert replicas_to_wait(plain) == 0 and replicas_to_wait(without_retries(plain)) == 0
    assert replicas_to_wait(ReplicatedRedis()) == 1 and replicas_to_wait(two) == 2
    kept = without_retries(two, timeout=0.5)
    assert isinstance(kept, ReplicatedRedis) and replicas_to_wait(kept) == 2 and kept is not two
    monkeypatch.setenv(envvars.REDIS_WAIT_REPLICAS, "0")  # the override wins either way
    assert replicas_to_wait(two) == 0
