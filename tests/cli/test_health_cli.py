"""``shoal health`` refuses bad input with one line and exit 2 before connecting to anything,
and ``shoal agent --heartbeat`` belongs to queue mode only."""

from __future__ import annotations

import pytest

from tests.helpers import run_cli


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["health", "agent", "--id", "c1"], "--id applies to `shoal health coordinator`"),
        (["health", "redis", "--name", "a"], "--name applies to `shoal health agent`"),
        (["agent", "somejob", "--heartbeat", "5"], "--heartbeat applies to --queue mode only"),
    ],
)
def test_misplaced_options_are_refused(args, needle):
    res = run_cli({"REDIS_URL": "redis://127.0.0.1:1/0", "PATH": "/usr/bin:/bin"}, *args, timeout=30)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == f"shoal: {needle}"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["health"], "required: component"),
        (["health", "worker"], "invalid choice: 'worker'"),
        (["health", "agent", "--max-age", "0"], "--max-age: expected a positive number, got 0"),
        (["health", "coordinator", "--lease-ttl", "-1"], "--lease-ttl: expected a positive number, got -1"),
        (["agent", "--queue", "--heartbeat", "x"], "--heartbeat: expected a positive number, got 'x'"),
    ],
)
def test_invalid_values_are_usage_errors(args, needle):
    res = run_cli({"PATH": "/usr/bin:/bin"}, *args, timeout=30)
    assert res.returncode == 2
    assert res.stderr.startswith("shoal: ") and res.stderr.count("\n") == 1 and needle in res.stderr
