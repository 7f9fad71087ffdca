"""Fixtures of the HTTP API tests: ``shoal serve`` as a real process against the session's
Redis, started with a token (``api_server``) or without one (``read_only_api_server``), and
an HTTP client of it."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shoal.ops.localproc import LocalProcs, Proc
from tests.helpers import wait_until

_LISTENING = re.compile(r"listening on (http://[\d.]+:\d+)")


@dataclass
class ApiServer:
    """A running ``shoal serve``: its process, base URL, token (None: read-only) and a client."""

    proc: Proc
    url: str
    token: str | None
    http: httpx.Client

    def auth(self, token: str | None = None) -> dict[str, str]:
        """The Authorization header with ``token`` (default: the server's own)."""
        return {"Authorization": f"Bearer {token or self.token}"}

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")


def start_serve(procs: LocalProcs, name: str, *args: str, timeout: float = 60) -> tuple[Proc, str]:
    """``python -m shoal serve --port 0 ARGS``; returns it and its base URL, read from its
    'listening on' line."""
    proc = procs.start(name, "serve", "--port", "0", *args)

    def listening() -> str | None:
        if proc.popen.poll() is not None:
            raise AssertionError(f"shoal serve exited {proc.popen.returncode}:\n{proc.log_tail()}")
        m = _LISTENING.search(proc.log_path.read_text(errors="replace")) if proc.log_path.exists() else None
        return m.group(1) if m else None

    return proc, wait_until(listening, timeout, "shoal serve to listen")


@pytest.fixture
def api_token(tmp_path: Path) -> tuple[str, Path]:
    token = secrets.token_urlsafe(24)
    path = tmp_path / "api-token"
    path.write_text(token + "\n")
    return token, path


@pytest.fixture
def api_server(procs: LocalProcs, api_token) -> ApiServer:
    """``shoal serve`` with a token (from ``--token-file``)."""
    token, path = api_token
    proc, url = start_serve(procs, "serve", "--token-file", str(path))
    with httpx.Client(base_url=url, timeout=30) as http:
        yield ApiServer(proc, url, token, http)


@pytest.fixture
def read_only_api_server(procs: LocalProcs, monkeypatch: pytest.MonkeyPatch) -> ApiServer:
    """``shoal serve`` without a token."""
    monkeypatch.delenv("SHOAL_API_TOKEN", raising=False)
    proc, url = start_serve(procs, "serve-ro")
    with httpx.Client(base_url=url, timeout=30) as http:
        yield ApiServer(proc, url, None, http)
