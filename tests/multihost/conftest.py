"""Fixtures of the multi-host tests: a network of namespaces per test (``net``), and the usual
cluster on it (``cluster``: Redis, a coordinator and two worker nodes, each its own host).

Both skip, with the reason, where namespaces cannot be made (not root, no ``ip``). Clean-up
runs in the fixture's teardown, also when the test failed; a SIGTERM to pytest is turned into
an exception so the teardown still runs; a run killed outright is swept by the next one (see
:mod:`shoal.ops.chaos.netns`, the harness, which ``shoal chaos --network`` uses too). Processes
in the hosts run from the repository root, so that ``tests.entrypoints`` is importable.
"""

from __future__ import annotations

import signal

import pytest

from shoal.ops.chaos.netns import Net, unavailable_reason
from tests.helpers import ROOT


def _terminated(signum, _frame):
    raise SystemExit(128 + signum)


@pytest.fixture
def net(tmp_path):
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        with Net(tmp_path / "net", cwd=ROOT) as n:
            yield n
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.fixture
def cluster(net):
    """``net`` with hosts ``redis`` (Redis running), ``coord``, ``n1`` and ``n2``."""
    net.start_redis(net.add_host("redis"))
    for name in ("coord", "n1", "n2"):
        net.add_host(name)
    return net
