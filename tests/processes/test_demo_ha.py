"""``shoal demo --ha`` (issue 29): the demo on a Sentinel HA set of the embedded binary (a
primary, 2 replicas, 3 sentinels) with two coordinator replicas: a worker is killed, then the
Redis primary; the job completes with every sample once and says how the fail-over went."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.soak]  # ~25 s: behind --soak (the suite keeps near 15 min); (a) covers the fail-over


def test_the_ha_demo_kills_the_primary_and_the_job_carries_on(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "shoal", "demo", "--ha", "--epochs", "8", "--report", ""],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "embedded Redis HA set: primary 127.0.0.1:" in text
    killed = re.search(r"--- kill -9 the Redis primary \(127\.0\.0\.1:(\d+)", text)
    promoted = re.search(r"--- the sentinels promoted 127\.0\.0\.1:(\d+) ([\d.]+) s after the kill", text)
    assert killed and promoted and killed.group(1) != promoted.group(1), text[-3000:]
    assert re.search(r"Redis fail-over     primary killed at step \d+: a replica promoted [\d.]+ s later; "
                     r"first step committed [\d.]+ s after it", text), text[-3000:]
    assert "job state           completed" in text
    assert "samples used exactly once per epoch: yes" in text
    assert "survivor(s) kept their processes" in text
    print(promoted.group(0))
