"""Fixtures shared by every layer: a real embedded Redis server per test session, a client
of it, unique job ids, the environment of child processes and of ``python -m shoal``
commands, ``LocalProcs`` against the session's server and the launch queue. Fixtures of one
layer only live in that layer's ``conftest.py`` (``tests/api``, ``tests/storage``,
``tests/multihost``); a fixture name means the same thing in every folder."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import uuid
from pathlib import Path

import pytest
import redis

from shoal.ops.embedded import start_server
from shoal.ops.localproc import LocalProcs
from tests.helpers import ROOT


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False, help="run long soak tests")
    parser.addoption("--extended", action="store_true", default=False,
                     help="run the extended tier too (EXTENDED: long end-to-end tests; .ci/run runs them after the suite)")


#: Test files that run many processes for a long time, or whose verdicts depend on timing
#: (heartbeat TTLs of 1-1.5 s, recovery times, "no failure without a fault"). The suite runs on
#: two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``); these files all
#: go to one of them, one test after another, so no two of them share the 2 cores at once,
#: while the other worker runs everything else (unit, control, cli, storage, the lighter
#: process tests). ``-n 0`` runs the suite in one process.
HEAVY = (
    "tests/api/test_dashboard_browser.py",
    "tests/cli/test_readme_using_it.py",  # also: examples/job.yaml's fixed /tmp/shoal-checkpoints
    "tests/multihost/",
    "tests/processes/test_chaos.py",
    "tests/processes/test_fault_phases.py",
    "tests/processes/test_fp16_processes.py",
    "tests/processes/test_hsdp.py",
    "tests/processes/test_hsdp_checkpoint.py",
    "tests/processes/test_hsdp_stall.py",  # recovery within 1 s of a coordinator's return
    "tests/processes/test_lm_memory.py",  # 2 x 6 GB, then 2 x 3.3 GB
    "tests/processes/test_hung_peer.py",
    "tests/processes/test_join_source_lost.py",  # a source frozen past a 1.5 s heartbeat TTL
    "tests/processes/test_large_join.py",
    "tests/processes/test_load_many_jobs.py",
    "tests/processes/test_demo_ha.py",
    "tests/processes/test_redis_failover.py",  # 6 Redis processes, 2 coordinators, 3 workers
    "tests/processes/test_prefetch_processes.py",
    "tests/processes/test_redis_loss.py",
    "tests/processes/test_redone_steps.py",
    "tests/processes/test_slow_peer.py",
    "tests/processes/test_streaming_processes.py",
    "tests/processes/test_training_elastic.py",
    "tests/processes/test_watchdog.py",
)


#: The extended tier: long end-to-end tests (node id prefixes) that the default suite leaves out
#: so it keeps under 15 minutes on 2 cores; ``--extended`` runs them and ``.ci/run`` runs them
#: after the default suite (``pytest --extended -m extended``). Each covers a path the default
#: suite also drives in a shorter or neighbouring test (named beside it).
EXTENDED = (
    # the 60 s chaos soaks; every fault kind has its own test in the same files
    "tests/processes/test_chaos.py::test_sixty_seconds_of_chaos_leave_a_correct_end_state",
    "tests/multihost/test_chaos_network.py::test_sixty_seconds_of_network_chaos_pass_with_every_fault_kind",
    # 2 x 6 GB for 3 minutes (tests/processes/test_hsdp_smoke.py and test_hsdp.py keep HSDP)
    "tests/processes/test_lm_memory.py",
    # one training job through a network fault each; partition-5s and leader-coordinator-cut-off stay
    "tests/multihost/test_faults.py::test_one_fault_during_training_is_ridden_out_exactly_once[redis-blackhole-10s]",
    "tests/multihost/test_faults.py::test_one_fault_during_training_is_ridden_out_exactly_once[oneway-partition-5s]",
    "tests/multihost/test_faults.py::test_one_fault_during_training_is_ridden_out_exactly_once[loss-5pct]",
    "tests/multihost/test_faults.py::test_one_fault_during_training_is_ridden_out_exactly_once[delay-20ms]",
    "tests/multihost/test_address.py::test_a_wrong_interface_fails_the_job_after_formation_timeout_naming_the_address",
    # resharding: the sharded checkpoint's test stays
    "tests/processes/test_hsdp_checkpoint.py::test_a_data_parallel_checkpoint_resumes_under_hsdp",
    "tests/processes/test_hsdp_checkpoint.py::test_a_compiled_jobs_checkpoint_resumes_uncompiled_and_the_other_way_round",
    "tests/processes/test_checkpoint_owner.py::test_warm_starts_between_data_parallel_and_sharded_checkpoints",
    # the stall's kill and leave stay; the finish after rank 0's group is lost
    "tests/processes/test_hsdp_stall.py::test_a_fault_inside_a_coordinator_stall_never_wedges_the_surviving_group[stop]",
    "tests/processes/test_hsdp_stall.py::test_a_finished_group_completes_the_job_when_rank_0s_group_cannot_finish",
    # compile through a kill, a join and a leave (tests/unit/test_compile*.py stay)
    "tests/processes/test_compile.py",
    "tests/processes/test_throughput_processes.py",
    "tests/processes/test_load_many_jobs.py::test_many_jobs_complete_through_worker_and_coordinator_kills",
    "tests/processes/test_streaming_processes.py::test_s3_bytes_per_epoch_three_workers_and_after_a_leave",
    "tests/processes/test_fault_phases.py::test_rank0_dies_at_a_checkpoint_phase_and_the_job_still_ends_exactly_once[ckpt_before_latest-kill]",
    "tests/processes/test_fault_phases.py::test_rank0_dies_at_a_checkpoint_phase_and_the_job_still_ends_exactly_once[ckpt_before_event-kill]",
    "tests/processes/test_diloco.py::test_a_diloco_job_completes_exactly_once_with_equal_global_weights[int8]",
    # DiLoCo over a slow link: exchanges of more than 100 s at 10 Mbit/s (fp32: 2 rounds, bf16: 1),
    # and an int8 message longer than the group's own timeout (the short exchanges and the
    # frozen member stay)
    "tests/multihost/test_slow_link.py::test_at_10_mbit_an_outer_exchange_longer_than_100_s_evicts_nobody",
    "tests/multihost/test_slow_link.py::test_a_compressed_message_longer_than_the_group_timeout_evicts_nobody",
    # the int8 exchange (its pieces) and the frozen member stay; fp32 is the default path, whole
    "tests/multihost/test_slow_link.py::test_an_outer_exchange_longer_than_the_step_timeout_evicts_nobody[fp32]",
    # a killed only source (DiLoCo and data parallelism) and a second live source stay
    "tests/processes/test_join_source_lost.py::test_a_joiner_whose_only_source_hangs_mid_transfer_is_released_by_its_eviction",
    # a DiLoCo join at a round boundary: test_join_source_lost's live-member test joins one too
    "tests/processes/test_diloco.py::test_a_joiner_joins_at_a_round_boundary_with_the_global_state",
    # the stall's kill stays (exclusive: it holds both xdist workers for its whole run)
    "tests/processes/test_hsdp_stall.py::test_a_fault_inside_a_coordinator_stall_never_wedges_the_surviving_group[leave]",
    # HSDP group joins and leaves, a frozen member: the killed member's test and test_hsdp_smoke stay
    "tests/processes/test_hsdp.py::test_a_group_joins_a_group_leaves_and_a_frozen_member_takes_its_group_out_within_the_ttl",
    # a primary cut off: test_redis_failover (a killed primary) and test_faults[partition-5s] stay
    "tests/multihost/test_redis_partition.py::test_a_primary_cut_off_with_a_coordinator_and_a_worker_loses_nothing",
    "tests/multihost/test_faults.py::test_one_fault_during_training_is_ridden_out_exactly_once[leader-coordinator-cut-off]",
    # prefetching is the default (loader_workers 1, prefetch_steps 2): every elastic process test drives it
    "tests/processes/test_prefetch_processes.py::test_prefetching_workers_survive_a_join_and_a_kill_exactly_once",
)


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _exclusive_slot(request: pytest.FixtureRequest):
    """A test marked ``exclusive`` (a verdict that a second test on the 2 cores could tip: the
    chaos soak's "no failure without a fault" counts a heartbeat thread starved past its TTL as
    a false failure) runs while the other xdist worker waits: every test holds a shared lock
    of this run, an exclusive one holds it alone. A gate lock keeps the shared holders from
    starving a waiting exclusive one. Nothing to do without xdist."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"shoal-pytest-{run}"
    alone = request.node.get_closest_marker("exclusive") is not None
    with _flock(base.with_suffix(".gate"), fcntl.LOCK_EX):
        hold = _flock(base.with_suffix(".lock"), fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        hold.__enter__()
    try:
        yield
    finally:
        hold.__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(HEAVY):
            item.add_marker(pytest.mark.xdist_group("heavy"))
        if item.nodeid.startswith(EXTENDED):
            item.add_marker(pytest.mark.extended)
    skips = {"soak": pytest.mark.skip(reason="long soak: run with --soak"),
             "extended": pytest.mark.skip(reason="extended tier: run with --extended (.ci/run does)")}
    for item in items:
        for tier, skip in skips.items():
            if tier in item.keywords and not config.getoption(f"--{tier}"):
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _run_from_root():
    """Run every test from the repository root: child processes (``python -m shoal ...``)
    inherit it, and ``-m`` puts it first on their ``sys.path``, which is how a job's
    ``tests.entrypoints:...`` entrypoint is found, as a user's module is from their cwd."""
    before = os.getcwd()
    os.chdir(ROOT)
    yield
    os.chdir(before)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real valkey/redis server on a free loopback port, for the whole session."""
    server = start_server(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url: str):
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield client
    client.close()


@pytest.fixture
def job_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def subprocess_env(redis_url: str) -> dict[str, str]:
    """Environment for real child processes: same server, no buffering. Children run from the
    repository root (see ``_run_from_root``), so ``tests.entrypoints`` is importable there."""
    env = dict(os.environ)
    env["REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def cli_env(subprocess_env: dict[str, str], tmp_path) -> dict[str, str]:
    """Environment of a ``python -m shoal`` command (``run_cli``): the session's Redis, the
    test's own ``SHOAL_HOME`` (never the user's ``~/.shoal``), one BLAS thread, no API token
    unless a test sets one."""
    env = {**subprocess_env, "SHOAL_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    env.pop("SHOAL_API_TOKEN", None)
    return env


@pytest.fixture
def procs(redis_url: str, tmp_path):
    """Real ``python -m shoal`` processes against the session's server, a log file each under
    ``tmp_path/logs``, every one reaped at the end. ``SHOAL_HOME`` is the test's own, so no
    process touches the user's ``~/.shoal``."""
    with LocalProcs(redis_url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as p:
        yield p


@pytest.fixture
def queue(r):
    """The RQ launch queue, emptied before the test (units another test left would be taken by
    an agent of this one) and after it, together with its intermediate queue."""
    from shoal.coordinator.launcher import launch_queue  # rq: only for the tests that use it

    q = launch_queue(r)
    q.empty()
    yield q
    q.empty()
    for rq_id in q.intermediate_queue.get_job_ids():
        q.intermediate_queue.remove(rq_id)
