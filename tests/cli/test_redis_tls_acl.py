"""Redis over TLS (``rediss://``) with AUTH, and a worker confined by the per-job ACL user of
deploy/users.acl.template, end to end with real processes.

A server of this module's own requires a password (so secrets exist to leak) and sits behind
a TLS-terminating proxy (tests/tlsproxy.py, a throwaway CA made with ``cryptography``): every
shoal process talks TLS on the wire. Afterwards every log file, every Redis value (events,
control and log streams, RQ payloads included) and ``shoal status --json`` are searched for
the passwords.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shoal.coordinator.launcher import launch_queue
from shoal.events.keys import job_keys, job_of_launch_unit
from shoal.ops.cli import main
from shoal.core.connection import connect, redact_url
from shoal.ops.embedded import start_server
from shoal.core.errors import ConnectionFailed
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.localproc import LocalProcs
from tests.helpers import ROOT, ControlWatcher
from tests.helpers import run_cli as shoal

pytest.importorskip("cryptography", reason="the test CA is made with the cryptography package")
from tests.tlsproxy import TlsProxy, make_pki  # noqa: E402

ADMIN_PW = "adm-7f3e9c2b5d1a4e8f"
WORKER_PW = "wrk-2c4e6a8b0d1f3e5a"
ACL_TEMPLATE = ROOT / "deploy" / "users.acl.template"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return make_pki(d / "ours"), make_pki(d / "stranger", cn="some other CA")


@pytest.fixture(scope="module")
def tls(tmp_path_factory, pki):
    """(proxy, server): a password-protected server reachable through TLS."""
    server = start_server(tmp_path_factory.mktemp("secure-redis"), appendonly=False, password=ADMIN_PW)
    proxy = TlsProxy(pki[0], server.port).start()
    yield proxy, server
    proxy.stop()
    server.stop()


def url(tls, pki, user: str = "default", pw: str = ADMIN_PW, ca=None, host: str = "127.0.0.1") -> str:
    ca = ca or pki[0].ca
    return f"rediss://{user}:{pw}@{host}:{tls[0].port}/0?ssl_ca_certs={ca}&ssl_check_hostname=true"


def spec(name: str, workers: int = 2) -> JobSpec:
    return JobSpec(name=name, entrypoint="simulate", min_workers=workers, max_workers=workers, global_batch_size=8,
                   heartbeat_interval=0.2, heartbeat_ttl=1.0, simulate_step_time=0.02, max_steps=25)


def every_value(client: redis.Redis) -> bytes:
    """Every key name and value in the server, whatever its type, as one blob."""
    out = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        value = {"string": lambda: client.get(key), "hash": lambda: client.hgetall(key),
                 "list": lambda: client.lrange(key, 0, -1), "set": lambda: client.smembers(key),
                 "zset": lambda: client.zrange(key, 0, -1, withscores=True),
                 "stream": lambda: client.xrange(key)}.get(kind, lambda: b"")()
        out.append(key + b" " + repr(value).encode())
    return b"\n".join(out)


def assert_no_secret(secrets: tuple[str, ...], *, files_under: Path, client: redis.Redis, texts: tuple[str, ...]) -> None:
    logs = [p for p in files_under.rglob("*") if p.is_file()]
    assert logs, "no log files to search"
    for s in secrets:
        for p in logs:
            assert s.encode() not in p.read_bytes(), f"{s[:4]}... in {p}"
        assert s.encode() not in every_value(client)
        for t in texts:
            assert s not in t


@pytest.mark.slow
def test_coordinator_agent_and_workers_run_a_submitted_job_over_tls(tls, pki, tmp_path, job_id, subprocess_env) -> None:
    proxy, server = tls
    admin_url = url(tls, pki)
    admin = connect(admin_url)
    env = {**subprocess_env, "REDIS_URL": admin_url, "SHOAL_HOME": str(tmp_path / "home")}
    (tmp_path / "job.yaml").write_text(json.dumps(spec(job_id).model_dump(mode="json")))
    before = proxy.handshakes

    res = shoal(env, "submit", str(tmp_path / "job.yaml"), "--workers", "2")
    assert res.returncode == 0, res.stderr
    [unit] = [i for i in launch_queue(admin).get_job_ids() if job_of_launch_unit(i) == job_id]
    watch = ControlWatcher(admin, job_id)
    with LocalProcs(admin_url, tmp_path / "logs", extra_env={"SHOAL_HOME": str(tmp_path / "home")}) as procs:
        procs.coordinator("coord", "--no-launcher")
        agent = procs.start("agent", "agent", "--queue", "--burst", "--run-dir", str(tmp_path / "logs" / "agent"))
        assert agent.wait(90) == 0, agent.log_tail()
        watch.wait_for(lambda d: d.job_state == "completed", 30)
        status = shoal(env, "status", job_id, "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["state"] == "completed"
    # submit, coordinator, agent, its work horse and two workers all came in through TLS
    assert proxy.handshakes - before >= 5
    job = Job.fetch(unit, connection=admin, serializer=JSONSerializer)
    assert job.args == [job_id, 2] and job.return_value()["state"] == "completed"
    keys = job_keys(job_id)
    assert admin.xlen(keys.control) and admin.xlen(keys.logs) and admin.exists(keys.events)
    # RQ keeps payloads zlib-compressed: decode every RQ job on the server for the search
    rq_jobs = [Job.fetch(k.decode().removeprefix("rq:job:"), connection=admin, serializer=JSONSerializer)
               for k in admin.scan_iter(match="rq:job:*") if admin.type(k) == b"hash"]
    payloads = [repr((j.func_name, j.args, j.kwargs, j.description, j.get_meta(), j.return_value())) for j in rq_jobs]
    assert any(job_id in p for p in payloads)
    assert_no_secret((ADMIN_PW,), files_under=tmp_path / "logs", client=admin,
                     texts=(status.stdout, status.stderr, res.stdout, res.stderr, *payloads))
    admin.close()


@pytest.mark.slow
def test_bad_tls_settings_are_one_line_without_the_password(tls, pki, subprocess_env, monkeypatch) -> None:
    stranger = url(tls, pki, ca=pki[1].ca)
    res = shoal({**subprocess_env, "REDIS_URL": stranger}, "status", "any-job")
    assert res.returncode == 3 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert "certificate verify failed" in res.stderr and ADMIN_PW not in res.stderr + res.stdout
    assert redact_url(stranger) in res.stderr
    plain = url(tls, pki).replace("rediss://", "redis://").split("?")[0]
    bad = {
        plain: "cannot reach Redis",  # plain RESP to the TLS port
        url(tls, pki, ca="/nonexistent/ca.pem"): "No such file",
        url(tls, pki, host="localhost").replace("localhost", "127.0.0.2"): "cannot reach Redis",
        url(tls, pki) + "&ssl_cert_reqs=bogus": "Invalid SSL Certificate Requirements Flag",
        url(tls, pki) + "&ssl_ca_cert=typo": "unexpected keyword argument 'ssl_ca_cert'",
        url(tls, pki, pw="wrong-password-0000"): "refused the credentials",
    }
    for u, needle in bad.items():
        with pytest.raises(ConnectionFailed) as info:
            connect(u)
        msg = str(info.value)
        assert "\n" not in msg and needle in msg and ADMIN_PW not in msg and "wrong-password-0000" not in msg, msg
    # the same through the CLI entry point: one line, exit 3
    monkeypatch.setenv("REDIS_URL", url(tls, pki) + "&ssl_ca_cert=typo")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["jobs"]) == 3
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("shoal: bad Redis URL"), err.getvalue()
    assert ADMIN_PW not in err.getvalue()


def _worker_acl_rules(job: str, password: str) -> list[str]:
    """The worker line of deploy/users.acl.template for ``job``, as ACL SETUSER arguments."""
    [line] = [ln for ln in ACL_TEMPLATE.read_text().splitlines() if ln.startswith("user shoal-worker-digits ")]
    digest = hashlib.sha256(password.encode()).hexdigest()
    line = line.replace("#@WORKER_DIGITS_PASSWORD_SHA256@", f"#{digest}").replace("digits", job)
    return line.split()[1:]


@pytest.mark.slow
def test_confined_worker_user_completes_its_job_and_touches_nothing_else(tls, pki, tmp_path, job_id) -> None:
    admin_url = url(tls, pki)
    admin = connect(admin_url)
    other = f"{job_id}-other"
    user, *rules = _worker_acl_rules(job_id, WORKER_PW)
    admin.execute_command("ACL", "SETUSER", user, *rules)
    try:
        create_job(admin, spec(job_id))
        create_job(admin, spec(other))
        worker_url = url(tls, pki, user=user, pw=WORKER_PW)
        watch = ControlWatcher(admin, job_id)
        logs = tmp_path / "logs"
        with LocalProcs(admin_url, logs) as coords, LocalProcs(worker_url, logs) as workers:
            coords.coordinator("coord", "--no-launcher")
            ws = [workers.worker(job_id, f"w{i}") for i in range(2)]
            intruder = workers.worker(other, "intruder")  # J's user cannot even read K's spec
            watch.wait_for(lambda d: d.job_state == "completed", 60)
            for w in ws:
                assert w.wait(30) == 0, w.log_tail()
            assert intruder.wait(30) == 3
            status = shoal(coords.env(), "status", job_id, "--json")
        tail = intruder.log_tail()
        assert tail.count("\n") == 0 and tail.startswith("shoal: ") and "No permissions" in tail, tail
        assert json.loads(status.stdout)["state"] == "completed"
        assert json.loads(admin.hget(job_keys(job_id).state, "summary"))["step"] == 25
        assert admin.hlen(job_keys(other).workers) == 0  # the intruder never joined the other job

        # what the worker's credentials can and cannot do
        w = connect(worker_url)
        assert w.get(job_keys(job_id).spec)
        refused = [
            lambda: w.get(job_keys(other).spec),
            lambda: w.xadd(job_keys(other).events, {"data": "{}"}),
            lambda: w.delete(job_keys(other).state),
            lambda: w.sadd("shoal:jobs", "x"),
            lambda: w.lpush("rq:queue:shoal-launch", "x"),
            lambda: w.flushall(),
            lambda: w.flushdb(),
            lambda: w.config_get("*"),
            lambda: w.config_set("appendonly", "no"),
            lambda: w.keys("*"),
            lambda: w.acl_list(),
        ]
        for call in refused:
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        assert admin.exists(job_keys(other).spec) and admin.dbsize() > 0
        w.close()
        assert_no_secret((WORKER_PW, ADMIN_PW), files_under=logs, client=admin,
                         texts=(status.stdout, status.stderr))
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def test_redact_url_hides_every_password_and_never_raises() -> None:
    assert redact_url("rediss://u:p%40ss@h:1/0?ssl_ca_certs=/c/ca.pem") == "rediss://u:***@h:1/0?ssl_ca_certs=/c/ca.pem"
    assert redact_url("redis://h:1/0?password=s3cret&db=2") == "redis://h:1/0?password=***&db=2"
    assert "kp" not in redact_url("rediss://h/0?ssl_password=kp")
    assert redact_url("redis://:pw@h/0") == "redis://:***@h/0"
    assert redact_url("redis://u:pw@h:notaport/0") == "redis://u:***@h:notaport/0"
    assert redact_url("redis://u:pw@[::1/0") == "<unparsable Redis URL>"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


@pytest.mark.parametrize("bad, needle", [
    ("redis://u:pw@127.0.0.1:notaport/0", "Port could not be cast"),
    ("redis://127.0.0.1:1/zero", "the database 'zero' is not a number"),
    ("redis://127.0.0.1:1/0?sockettimeout=1", "unexpected keyword argument 'sockettimeout'"),
    ("rediss://127.0.0.1:1/0?ssl_cert_reqs=sometimes", "Invalid SSL Certificate Requirements Flag"),
    ("http://127.0.0.1:1/0", "Redis URL must specify one of the following schemes"),
])
def test_malformed_urls_are_one_config_line(bad, needle) -> None:
    with pytest.raises(ConnectionFailed) as info:
        connect(bad, check=False)
    msg = str(info.value)
    assert msg.startswith("bad Redis URL ") and needle in msg and "\n" not in msg and ":pw@" not in msg
