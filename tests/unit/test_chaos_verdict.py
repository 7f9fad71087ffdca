"""The chaos soak's judge on made-up runs: the checks that catch a harness that stopped
injecting and failures that no fault explains (the soak itself runs in test_chaos.py)."""

from __future__ import annotations

from shoal.ops.chaos.kinds import Injected
from shoal.ops.chaos.sampler import Samples
from shoal.ops.chaos.verdict import MAX_QUIET, judge


def _checks(faults: list[Injected], failed: list[str]) -> dict[str, tuple[bool, str]]:
    v = judge(completed=True, final_step=0, elapsed=1.0, entries=[], num_samples=10, finals={}, reference=None,
              samples=Samples(), faults=faults, window=120.0, duration=120.0, failed=failed)
    return {c.name: (c.ok, c.detail) for c in v.checks}


def test_a_long_spell_without_faults_fails_the_window_check() -> None:
    steady = [Injected("worker_kill", t, f"w{i} (pid {i})", 1, f"w{i}") for i, t in enumerate(range(0, 120, 4))]
    assert _checks(steady, [])["faults for the whole window"][0]
    stalled = steady[:5] + [Injected("redis_restart", steady[4].t + MAX_QUIET + 1, "redis", -1)]
    ok, detail = _checks(stalled, [])["faults for the whole window"]
    assert not ok and f"longest spell without a fault {MAX_QUIET + 1:.1f} s" in detail


def test_a_worker_declared_failed_that_no_fault_hit_fails_the_soak() -> None:
    faults = [Injected("worker_stop", 1.0, "w3 (pid 11)", 2, "w3"), Injected("worker_join", 2.0, "joiner1", 2),
              Injected("worker_segv", 3.0, "w5 (pid 12)", 3, "w5")]
    assert _checks(faults, ["w3", "w5", "w3"])["no failure without a fault"] == (
        True, "2 workers declared failed, each hit by a fault")
    ok, detail = _checks(faults, ["w3", "w12", "w5", "w4"])["no failure without a fault"]
    assert not ok and "w4, w12" in detail


def test_a_worker_declared_failed_after_only_a_slow_step_fails_the_soak() -> None:
    # a slow step must cost nobody their membership: it does not excuse a failure
    faults = [Injected("worker_slow", 1.0, "w2 (pid 10)", 2, "w2"), Injected("worker_kill", 5.0, "w3 (pid 11)", 3, "w3")]
    assert _checks(faults, ["w3"])["no failure without a fault"][0]
    ok, detail = _checks(faults, ["w2", "w3"])["no failure without a fault"]
    assert not ok and "declared failed without a fault: w2" in detail


def test_a_slow_step_is_survived_by_a_step_after_its_stall_in_the_same_generation() -> None:
    from shoal.ops.chaos.verdict import recovery_times

    slow = Injected("worker_slow", 1.0, "w2 (pid 10)", 2, "w2", healed=5.0)
    during = [{"t": 3.0, "generation": 2}]  # committed while the stall lasted: not yet survived
    assert recovery_times([slow], during)[1] == {"worker_slow": (1, 0)}
    times, counts = recovery_times([slow], during + [{"t": 5.5, "generation": 2}])
    assert counts == {"worker_slow": (1, 1)} and times == [0.5]
    # a lost worker still needs a newer generation
    kill = Injected("worker_kill", 1.0, "w3 (pid 11)", 2, "w3")
    assert recovery_times([kill], [{"t": 5.5, "generation": 2}])[1] == {"worker_kill": (1, 0)}
