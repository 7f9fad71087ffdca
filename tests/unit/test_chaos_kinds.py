"""The registry of chaos fault kinds (ops/chaos/kinds.py) against the soaks and the verdict:
every kind is drawn by a soak or says why not, and the recovery each kind declares is the one
the verdict applies. (What each kind does to real processes: tests/processes/test_chaos.py,
to real namespaces: tests/multihost/test_chaos_network.py.)"""

from __future__ import annotations

import pytest

from shoal.ops.chaos.kinds import NOT_HELD, REGISTRY, Injected, Kind, Soak, SoakRange, find
from shoal.ops.chaos.sampler import Samples
from shoal.ops.chaos.verdict import judge, recovery_times

ENTRIES = [(soak, kind) for kind in REGISTRY for soak in sorted(kind.soaks, key=lambda s: s.value)]


def test_every_kind_is_drawn_by_a_soak_or_explicitly_disabled() -> None:
    for kind in REGISTRY:
        drawn_by = [soak for soak in Soak if kind.name in soak.kinds and find(soak, kind.name) is kind]
        if kind.disabled:
            assert not drawn_by, f"{kind.name} is disabled ({kind.disabled}) yet drawn by {drawn_by}"
        else:
            assert drawn_by, f"{kind.name} is drawn by no soak: name its soak(s), or disable it with the reason"
            assert set(drawn_by) == set(kind.soaks), kind.name
    for soak in Soak:
        assert soak.kinds, soak
        assert len(set(soak.kinds)) == len(soak.kinds), f"a name twice in the {soak.value} soak: {soak.kinds}"
    # an HA soak injects every network kind, and more
    assert set(Soak.NETWORK.kinds) < set(Soak.HA.kinds)


@pytest.mark.parametrize(("soak", "kind"), ENTRIES, ids=[f"{s.value}-{k.name}" for s, k in ENTRIES])
def test_each_entry_can_be_run_by_its_soaks(soak: Soak, kind: Kind) -> None:
    assert callable(kind.allowed) and callable(kind.inject), kind.name
    assert kind.does and not kind.does.endswith("."), kind.name
    if soak is Soak.LOCAL:  # the local soak has no --min-hold/--max-hold
        assert not isinstance(kind.hold, SoakRange), f"{kind.name}: a local kind held for the soak's hold range"
    else:  # the network soak tracks hosts, not workers, and reads no generation
        assert not (kind.worker_fault or kind.settle_ttls or kind.worker_rule), kind.name


@pytest.mark.parametrize(("soak", "kind"), ENTRIES, ids=[f"{s.value}-{k.name}" for s, k in ENTRIES])
def test_each_kinds_declared_recovery_is_what_the_verdict_applies(soak: Soak, kind: Kind) -> None:
    """A fault at t=10 in generation 5 (held: healed at 13), and one committed step at a time:
    survived, and timed, exactly as the entry declares."""
    held = kind.hold is not NOT_HELD
    since = 13.0 if held and kind.recovery.after_heal else 10.0
    for t, generation in [(9.0, 6), (11.0, 5), (11.5, 6), (14.0, 5), (14.5, 6)]:
        fault = Injected(kind.name, 10.0, "target", 5, "w1", healed=13.0 if held else 0.0)
        times, counts = recovery_times([fault], [{"t": t, "generation": generation}], soak)
        survived = t > since and (generation > 5 or not kind.recovery.newer_generation)
        assert counts == {kind.name: (1, int(survived))}, (kind.name, t, generation)
        assert times == ([t - since] if survived and kind.timed else []), (kind.name, t, generation)


@pytest.mark.parametrize(("soak", "kind"), ENTRIES, ids=[f"{s.value}-{k.name}" for s, k in ENTRIES])
def test_a_kind_excuses_the_failure_of_the_worker_it_hit_only_if_it_may_end_it(soak: Soak, kind: Kind) -> None:
    v = judge(completed=True, final_step=0, elapsed=1.0, entries=[], num_samples=10, finals={}, reference=None,
              samples=Samples(), faults=[Injected(kind.name, 1.0, "w1 (pid 10)", 2, "w1")], window=60.0,
              duration=60.0, failed=["w1"], soak=soak)
    check = {c.name: c.ok for c in v.checks}["no failure without a fault"]
    assert check == kind.may_fail_worker, kind.name


@pytest.mark.parametrize("soak", list(Soak))
def test_the_table_lists_each_soaks_kinds_in_registry_order(soak: Soak) -> None:
    v = judge(completed=True, final_step=0, elapsed=1.0, entries=[], num_samples=10, finals={}, reference=None,
              samples=Samples(), faults=[], window=60.0, duration=60.0, soak=soak)
    rows = [line.split()[0] for line in v.table().splitlines()[1:len(soak.kinds) + 1]]
    assert rows == [k.name for k in REGISTRY if soak in k.soaks and not k.disabled]
    assert list(v.summary()["faults"]) == rows
