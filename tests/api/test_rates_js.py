"""The dashboard's throughput line (``ops/api/static/rates.js``) follows the one rule of
``shoal.core.throughput.rolling_rates``: the file is run in node on the same points and must
give the same rates (skipped where node is not installed)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from shoal.core.throughput import rolling_rates
from shoal.ops.api.app import STATIC


def test_the_dashboard_computes_the_window_rate_as_status_does() -> None:
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    # steady, a long evaluation step, a pause, a resume from an older step, slow steps
    t = [0.0, 0.5, 1.0, 1.5, 4.5, 5.0, 5.5, 30.0, 30.5, 31.0, 70.0, 130.0]
    steps = [0, 5, 10, 15, 16, 21, 26, 27, 20, 25, 26, 27]
    want = rolling_rates(list(zip(t, steps)), window_s=10.0)
    script = (f"const {{ windowRates }} = require({json.dumps(str(STATIC / 'rates.js'))});"
              f"console.log(JSON.stringify(windowRates({json.dumps([x * 1000 for x in t])}, {json.dumps(steps)}, 10)));")
    got = json.loads(subprocess.run([node, "-e", script], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert got[0] is None and want[0] is None
    assert got[1:] == pytest.approx(want[1:])
