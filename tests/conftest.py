"""Shared fixtures: a real embedded Redis server per test session, unique job ids per test."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shoal.embedded import start_server  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", default=False, help="run long soak tests")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="long soak: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real valkey/redis server on a free loopback port, for the whole session."""
    server = start_server(tmp_path_factory.mktemp("redis"), appendonly=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def r(redis_url: str):
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield client
    client.close()


@pytest.fixture
def job_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def subprocess_env(redis_url: str) -> dict[str, str]:
    """Environment for real child processes: same server, project importable, no buffering."""
    env = dict(os.environ)
    env["REDIS_URL"] = redis_url
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
