"""Fixtures of the storage tests (their helpers are in ``support.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.storage.backend import ObjectStore
from tests.storage.support import BACKENDS, make_store


@pytest.fixture(params=BACKENDS)
def object_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """A fresh store of every backend in turn: the in-process fake, local files, and a bucket
    of the real S3 server."""
    return make_store(request.param, tmp_path)
