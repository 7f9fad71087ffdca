"""Fixtures of the operator-tooling tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def env(subprocess_env: dict[str, str], tmp_path) -> dict[str, str]:
    """Environment of a ``python -m shoal`` command: the session's Redis, the test's own
    ``SHOAL_HOME`` (never the user's ``~/.shoal``), one BLAS thread."""
    return {**subprocess_env, "SHOAL_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
