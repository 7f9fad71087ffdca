"""A link you can set (issue 38, item 8): a host's link gets a rate (TBF on both ends of its
veth) plus, optionally, the existing delay line, and the gate before a run measures the
throughput through it: it passes a link that carries its rate and refuses, in one line, one
that does not carry it or is not limited at all. Heal takes the rate away; nothing made here
outlives the network (the fixture's teardown and ``test_harness`` check that)."""

from __future__ import annotations

import shutil

import pytest

from shoal.ops.chaos.netns import LinkCheckFailed

pytestmark = pytest.mark.slow

RATE = 20  # Mbit/s: what a loaded 2-core machine pushes through veths many times over


def _qdiscs(host) -> str:
    return host.exec("tc", "qdisc", "show", "dev", "eth0").stdout


def test_a_set_rate_is_measured_through_the_link_and_a_link_that_misses_it_is_refused(net) -> None:
    if shutil.which("tc") is None:
        pytest.skip("a link's rate needs tc (Debian package iproute2)")
    a, b = net.add_host("a"), net.add_host("b")
    # not limited: a check for 20 Mbit/s is refused, the rate not being applied
    with pytest.raises(LinkCheckFailed) as err:
        net.check_link(a, b, RATE)
    assert "the rate is not applied" in str(err.value) and "\n" not in str(err.value)

    net.set_link(b, RATE)
    assert "tbf" in _qdiscs(b)
    got = net.check_link(a, b)  # the rate set on b's link, within 80 %..125 %
    assert 0.8 * RATE <= got <= 1.25 * RATE
    assert 0.8 * RATE <= net.check_link(b, a) <= 1.25 * RATE  # the other way is paced too

    # a run that needs 4x the link's rate is refused, naming what the link carries
    with pytest.raises(LinkCheckFailed) as err:
        net.check_link(a, b, 4 * RATE)
    msg = str(err.value)
    assert msg.startswith("link a -> b carries ") and f"below 80% of the {4 * RATE} Mbit/s set" in msg
    assert "\n" not in msg

    net.heal()
    assert "tbf" not in _qdiscs(b) and not net.rates


def test_rate_and_delay_together_and_a_bad_rate(net) -> None:
    if shutil.which("tc") is None or shutil.which("nft") is None:
        pytest.skip("needs tc and the delay line's tools")
    a, b = net.add_host("a"), net.add_host("b")
    with pytest.raises(ValueError, match="mbit must be in"):
        net.set_link(b, 0)
    net.set_link(b, RATE, delay_ms=20)  # 40 ms more per round trip: the stream still reaches the rate
    assert net.check_link(a, b, seconds=3.0, warm=1.5) >= 0.8 * RATE
    net.heal()
    assert "tbf" not in _qdiscs(b)
