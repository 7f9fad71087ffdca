"""The extended tier (tests/conftest.py ``EXTENDED``) names tests that exist: a renamed test or
parameter must not leave the tier silently (and then run in neither the default suite nor CI's
second pass)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import EXTENDED
from tests.helpers import ROOT


def test_every_extended_entry_names_collected_tests() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "--extended",
                          "-m", "extended", "-p", "no:cacheprovider", *sorted({e.split("::")[0] for e in EXTENDED})],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    missing = [e for e in EXTENDED if not any(i.startswith(e) for i in ids)]
    assert not missing, f"EXTENDED entries that match no test: {missing}"
    assert len(ids) >= len(EXTENDED)
