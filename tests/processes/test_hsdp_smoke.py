"""The GPU check's HSDP part (``scripts/hsdp_smoke.py``) dry-run on CPU, so the script the GPU
machine runs is kept working without one: 3 replica groups of shard_size 1, FSDP2 over each,
a gloo cross-replica group, replicas identical and allclose to one process."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_gpu_checks_hsdp_smoke_passes_on_cpu() -> None:
    out = subprocess.run([sys.executable, "scripts/hsdp_smoke.py", "--cpu"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    line = re.search(r"hsdp-smoke: .*replicas identical, max \|diff\| to one process (\S+)", out.stdout)
    assert line and float(line.group(1)) < 1e-4, out.stdout
