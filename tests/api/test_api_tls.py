"""``shoal serve`` against Redis over TLS (``rediss://``) with a password: the same REDIS_URL
handling as the CLI (tests/cli/test_redis_tls_acl.py's server and throwaway CA), and the
password in no response and no log line."""

from __future__ import annotations

import httpx
import pytest

from shoal.ops.localproc import LocalProcs
from tests.api.conftest import start_serve

pytest.importorskip("cryptography", reason="the test CA is made with the cryptography package")
from tests.cli.test_redis_tls_acl import ADMIN_PW, pki, tls, url  # noqa: E402,F401 (fixtures)

pytestmark = pytest.mark.slow


def test_serve_talks_tls_with_a_password_and_never_shows_it(tls, pki, tmp_path, job_id, api_token) -> None:  # noqa: F811
    token, token_file = api_token
    with LocalProcs(url(tls, pki), tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
        proc, base = start_serve(procs, "serve-tls", "--token-file", str(token_file))
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/health").json()["status"] == "ok"
            spec = {"name": job_id, "entrypoint": "simulate"}
            made = http.post("/jobs", json={"spec": spec, "queue": False}, headers={"Authorization": f"Bearer {token}"})
            assert made.status_code == 201, made.text
            texts = [made.text] + [http.get(p).text for p in ("/jobs", f"/jobs/{job_id}", f"/jobs/{job_id}/summary",
                                                              "/jobs/summaries", "/health")]
            assert http.get(f"/jobs/{job_id}").json()["spec"]["name"] == job_id
        log = proc.log_path.read_text()
    assert not any(ADMIN_PW in t for t in texts) and ADMIN_PW not in log and token not in log
    assert "rediss://default:***@127.0.0.1" in log
