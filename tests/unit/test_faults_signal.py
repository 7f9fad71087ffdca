"""Fault rules armed by a signal (``WHO@usr1:PHASE:ACTION``): real SIGUSR1s, no sleeping."""

from __future__ import annotations

import os
import signal

import pytest

from shoal.core.faults import ON_USR1, BadFaultRule, FaultPlan, InjectedFault, Rule, parse


@pytest.fixture
def restore_usr1():
    before = signal.getsignal(signal.SIGUSR1)
    yield
    signal.signal(signal.SIGUSR1, before)


def test_a_signal_armed_rule_fires_once_per_sigusr1_at_its_phase(restore_usr1) -> None:
    assert parse("*@usr1:mid_step:raise") == [Rule("*", ON_USR1, "mid_step", "raise")]
    plan = FaultPlan(parse("w1@usr1:mid_step:raise"))
    plan.at("w1", 3, "mid_step")  # not armed: nothing
    os.kill(os.getpid(), signal.SIGUSR1)
    plan.at("w1", 4, "before_step")  # armed, but another phase
    plan.at("w2", 4, "mid_step")  # armed, but another worker
    with pytest.raises(InjectedFault, match=r"w1@usr1:mid_step \(step 4\)"):
        plan.at("w1", 4, "mid_step")
    plan.at("w1", 5, "mid_step")  # spent: one firing per signal
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    for step in (6, 7):
        with pytest.raises(InjectedFault):
            plan.at("w1", step, "mid_step")
    plan.at("w1", 8, "mid_step")


def test_a_plan_without_signal_rules_leaves_sigusr1_alone(restore_usr1) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    FaultPlan(parse("w1@3:mid_step:raise"))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    with pytest.raises(BadFaultRule, match="N a number or usr1"):
        parse("w1@usr2:mid_step:raise")
