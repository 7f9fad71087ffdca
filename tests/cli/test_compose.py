"""The deployment files: compose.yaml, Dockerfile, deploy/ (env, redis.conf, ACL recipe, scripts).

Plain-YAML tests always run. ``docker-compose config`` (or ``docker compose config``) runs when
the tool exists; otherwise those tests are skipped with the reason. The Redis config and the
ACL recipe are exercised against the embedded Redis-compatible server (valkey) shipped with
the project.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from shoal.ops.embedded import free_port, server_binary
from shoal.core.jobspec import load_spec
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
DEPLOY = ROOT / "deploy"

SECRETS = ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY")
SERVICES = {"redis", "minio", "minio-init", "coordinator-a", "coordinator-b", "agent", "submit", "preflight"}
TEST_ENV = {
    "REDIS_PASSWORD": "0f1e2d3c4b5a69788796a5b4c3d2e1f0",
    "S3_ACCESS_KEY": "testaccesskey",
    "S3_SECRET_KEY": "testsecretkey-9f8e7d",
}
_INTERP = re.compile(r"\$\{[A-Z0-9_]+(?::?[-?][^}]*)?\}")


def compose_source() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def published_ports(service: dict) -> list[tuple[str, str]]:
    """(host_ip, published) for each port of a service, short or long syntax."""
    out = []
    for p in service.get("ports", []) or []:
        if isinstance(p, dict):  # long syntax (docker compose v2 config output)
            if p.get("published") in (None, ""):
                continue
            out.append((str(p.get("host_ip", "")), str(p["published"])))
            continue
        spec = str(p).split("/", 1)[0]
        if spec.startswith("["):  # [::1]:6379:6379
            host, _, rest = spec[1:].partition("]:")
            out.append((host, rest.split(":")[0]))
            continue
        parts = spec.split(":")
        if len(parts) == 1:  # "6379": published on a random port on every interface
            out.append(("", "random"))
        elif len(parts) == 2:  # "6379:6379": every interface
            out.append(("", parts[0]))
        else:
            out.append((":".join(parts[:-2]), parts[-2]))
    return out


def command_list(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else [str(c) for c in cmd]


def check_invariants(services: dict) -> None:
    """What must hold both in compose.yaml and in the tool's rendered config."""
    assert SERVICES <= set(services), f"missing services: {SERVICES - set(services)}"
    for name, svc in services.items():
        for host, published in published_ports(svc):
            assert host == "127.0.0.1", f"{name} publishes port {published} on {host or 'every interface'}"
    redis_cmd = command_list(services["redis"])
    i = redis_cmd.index("--appendonly")
    assert redis_cmd[i + 1] == "yes"
    assert "--requirepass" in redis_cmd
    # With an ACL file Redis ignores requirepass and makes `default` nopass: never both.
    assert "--aclfile" not in redis_cmd
    assert services["redis"].get("healthcheck"), "redis needs a healthcheck"
    assert command_list(services["coordinator-a"]) == ["shoal", "coordinator"]
    assert command_list(services["coordinator-b"]) == ["shoal", "coordinator"]
    assert command_list(services["agent"]) == ["shoal", "agent"]
    assert services["agent"]["deploy"]["replicas"] >= 1
    assert command_list(services["submit"]) == ["shoal", "submit", "examples/job-s3.yaml"]
    assert services["submit"].get("restart") == "no"
    assert services["minio-init"]["image"].startswith("minio/mc")
    for name in ("coordinator-a", "coordinator-b", "agent", "submit"):
        env = services[name]["environment"]
        assert {"REDIS_URL", "S3_ENDPOINT", "S3_ACCESS_KEY", "S3_SECRET_KEY"} <= set(env), name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


# --- compose.yaml as plain YAML (always) -----------------------------------------------------


def test_compose_source_invariants() -> None:
    check_invariants(compose_source()["services"])


def test_no_credential_literal_in_compose() -> None:
    text = COMPOSE.read_text()
    services = compose_source()["services"]
    secretish = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN|ROOT_USER|AUTH", re.I)
    for name, svc in services.items():
        env = svc.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        for key, value in env.items():
            if secretish.search(key):
                assert _INTERP.fullmatch(str(value)), f"{name}.environment.{key} is not a ${{...}} reference"
            if key == "REDIS_URL":
                m = re.fullmatch(r"rediss?://default:(.*)@redis:6379/0", str(value))
                assert m and _INTERP.fullmatch(m.group(1)), f"{name}: REDIS_URL password must be ${{REDIS_PASSWORD...}}"
    cmd = command_list(services["redis"])
    assert _INTERP.fullmatch(cmd[cmd.index("--requirepass") + 1])
    # nothing from the example env file (placeholders) or a default credential is baked in
    for line in (DEPLOY / "env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert line.split("=", 1)[1] not in text
    assert "minioadmin" not in text
    assert not re.search(r"\$\{(REDIS_PASSWORD|S3_ACCESS_KEY|S3_SECRET_KEY):?-", text), "a secret has a default"


def test_secrets_are_mandatory_in_compose() -> None:
    text = COMPOSE.read_text()
    refs = re.findall(r"\$\{(REDIS_PASSWORD|S3_ACCESS_KEY|S3_SECRET_KEY)([^}]*)\}", text)
    assert {name for name, _ in refs} == set(SECRETS)
    for name, rest in refs:
        assert rest == f":?set {name} in .env", f"${{{name}{rest}}} must refuse to start when unset"


def test_env_example_has_placeholders_for_every_secret() -> None:
    values = dict(
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    )
    assert set(SECRETS) <= set(values)
    for name in SECRETS:
        assert values[name].startswith("change-me-"), name


def test_redis_conf_and_ignore_files() -> None:
    conf = (DEPLOY / "redis.conf").read_text()
    directives = {line.split()[0]: line.split()[1:] for line in conf.splitlines() if line.strip() and not line.startswith("#")}
    assert directives["appendonly"] == ["yes"]
    assert directives["maxmemory-policy"] == ["noeviction"]
    assert "aclfile" not in directives and "requirepass" not in directives and "user" not in directives
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ".env" in dockerignore and ".git" in dockerignore and ".venv" in dockerignore


def test_dockerfile() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    assert code[0] == "FROM python:3.11-slim"
    assert "RUN pip install torch==2.13.0" in code
    assert any(line.startswith("RUN pip install .") for line in code)
    assert not any("index-url" in line for line in lines)
    users = [line for line in code if line.startswith("USER ")]
    assert users and users[-1] not in ("USER root", "USER 0")


def test_example_jobs_validate() -> None:
    local = load_spec(ROOT / "examples" / "job.yaml")  # as shipped: trains with local checkpoints
    assert local.checkpoint_uri == "file:///tmp/shoal-checkpoints/digits"
    spec = load_spec(ROOT / "examples" / "job-s3.yaml")  # what the compose stack submits
    assert spec.model_dump() == local.model_copy(update={"checkpoint_uri": spec.checkpoint_uri}).model_dump()
    assert spec.name == "digits"
    assert spec.entrypoint == "shoal.examples.digits:build"
    assert spec.checkpoint_uri == "s3://shoal-checkpoints/digits"
    bucket = compose_source()["services"]["minio-init"]["environment"]["SHOAL_BUCKET"]
    assert spec.checkpoint_uri.startswith(f"s3://{bucket}/"), "minio-init must create the job's bucket"


# --- the compose tool (when installed) --------------------------------------------------------


def compose_tool() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def run_config(tmp_path: Path, env_values: dict[str, str]) -> subprocess.CompletedProcess:
    tool = compose_tool()
    if tool is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed (apt-get install docker-compose)")
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env_values.items()))
    # the caller's environment must not supply (or override) the credentials under test
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "S3_ENDPOINT"}
    return subprocess.run(
        [*tool, "--env-file", str(env_file), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_compose_config_renders(tmp_path: Path) -> None:
    res = run_config(tmp_path, TEST_ENV)
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    check_invariants(services)
    pw = TEST_ENV["REDIS_PASSWORD"]
    for name in ("coordinator-a", "coordinator-b", "agent", "submit"):
        env = services[name]["environment"]
        assert env["REDIS_URL"] == f"redis://default:{pw}@redis:6379/0"
        assert env["S3_ENDPOINT"] == "http://minio:9000"
        assert env["S3_ACCESS_KEY"] == TEST_ENV["S3_ACCESS_KEY"]
        assert env["S3_SECRET_KEY"] == TEST_ENV["S3_SECRET_KEY"]
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == TEST_ENV["S3_SECRET_KEY"]


@pytest.mark.parametrize("missing", SECRETS)
def test_compose_refuses_to_start_without_credentials(tmp_path: Path, missing: str) -> None:
    res = run_config(tmp_path, {k: v for k, v in TEST_ENV.items() if k != missing})
    assert res.returncode != 0
    assert f"set {missing} in .env" in res.stderr + res.stdout
    for value in TEST_ENV.values():
        assert value not in res.stderr  # the other secrets are not echoed in the error


# --- deploy/preflight.sh (needs only sh) -------------------------------------------------------


def preflight(env_values: dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env_values}
    return subprocess.run(["sh", str(DEPLOY / "preflight.sh")], capture_output=True, text=True, env=env, timeout=30)


def test_preflight_accepts_real_credentials() -> None:
    res = preflight(TEST_ENV)
    assert res.returncode == 0, res.stderr
    assert all(v not in res.stdout + res.stderr for v in TEST_ENV.values())


def test_preflight_refuses_the_example_env_file() -> None:
    values = dict(
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    )
    res = preflight(values)
    assert res.returncode == 1
    for name in SECRETS:
        assert f"shoal: {name} in .env is still the placeholder" in res.stderr
    assert "change-me" not in res.stderr.replace("deploy/env.example", "")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"REDIS_PASSWORD": ""}, "REDIS_PASSWORD is not set"),
        ({"REDIS_PASSWORD": "short"}, "REDIS_PASSWORD must be at least 16"),
        ({"REDIS_PASSWORD": "has@and/slash:colon-long-enough"}, "REDIS_PASSWORD goes into REDIS_URL"),
        ({"S3_SECRET_KEY": "1234567"}, "S3_SECRET_KEY must be at least 8"),
    ],
)
def test_preflight_refuses_unusable_credentials(change: dict[str, str], needle: str) -> None:
    res = preflight({**TEST_ENV, **change})
    assert res.returncode == 1
    assert needle in res.stderr
    for value in change.values():
        if value:
            assert value not in res.stderr


# --- deploy/redis.conf and the ACL recipe against a real server ---------------------------------


class Server:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(server_binary()), *args, "--bind", "127.0.0.1", "--port", str(self.port),
             "--dir", str(tmp), "--save", "", "--logfile", str(tmp / "server.log"), "--daemonize", "no"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.log = tmp / "server.log"
        try:
            wait_until(self._answers, 10, lambda: f"the server to answer: {self._log_tail()}")
        except AssertionError:
            self.stop()
            raise

    def _answers(self) -> bool:
        try:
            self.client().ping()
        except (redis.AuthenticationError, redis.ResponseError):
            pass  # it answers: NOAUTH means it is up and wants a password
        except redis.ConnectionError:
            assert self.proc.poll() is None, f"the server exited: {self._log_tail()}"
            return False
        return True

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-500:] if self.log.exists() else ""

    def client(self, username: str | None = None, password: str | None = None) -> redis.Redis:
        # no retries: redis-py retries ConnectionError (AuthenticationError is one) with backoff
        return redis.Redis(
            host="127.0.0.1", port=self.port, username=username, password=password,
            socket_timeout=5, retry=Retry(NoBackoff(), 0),
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def test_redis_conf_with_requirepass_needs_the_password(tmp_path: Path) -> None:
    pw = TEST_ENV["REDIS_PASSWORD"]
    # the same arguments as compose.yaml's redis command (dir overridden for the test)
    server = Server(tmp_path, str(DEPLOY / "redis.conf"), "--appendonly", "yes", "--requirepass", pw)
    try:
        with pytest.raises(redis.AuthenticationError):
            server.client().ping()
        admin = server.client("default", pw)
        assert admin.ping()
        assert admin.config_get("appendonly") == {"appendonly": "yes"}
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    finally:
        server.stop()


def test_requirepass_with_aclfile_would_open_the_server(tmp_path: Path) -> None:
    """Why compose.yaml never combines them: an ACL file without `user default` makes Redis
    ignore requirepass and re-create `default` as nopass."""
    acl = tmp_path / "users.acl"
    acl.write_text("user someone on >pw ~x resetchannels -@all\n")
    server = Server(tmp_path, "--requirepass", "not-used-at-all", "--aclfile", str(acl))
    try:
        assert server.client().ping()  # no password needed: open
    finally:
        server.stop()


def test_acl_recipe_confines_the_worker(tmp_path: Path) -> None:
    default_pw, worker_pw = TEST_ENV["REDIS_PASSWORD"], "worker-pw-5c1d9e0a7b3f"
    out = tmp_path / "users.acl"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "REDIS_PASSWORD": default_pw,
           "REDIS_WORKER_DIGITS_PASSWORD": worker_pw}
    res = subprocess.run(["sh", str(DEPLOY / "render-acl.sh"), str(out)], capture_output=True, text=True, env=env, timeout=30)
    assert res.returncode == 0, res.stderr
    rendered = out.read_text()
    assert default_pw not in rendered and worker_pw not in rendered and "@" not in rendered.replace("+@", "").replace("-@", "")
    assert default_pw not in res.stdout + res.stderr
    assert oct(out.stat().st_mode & 0o777) == "0o600"

    server = Server(tmp_path, "--aclfile", str(out))
    try:
        with pytest.raises(redis.AuthenticationError):
            server.client().ping()
        admin = server.client("default", default_pw)
        admin.set("shoal:{other}:spec", "x")
        w = server.client("shoal-worker-digits", worker_pw)
        # its own job's keys: strings, streams, lists, zsets, scripts, scans
        assert w.set("shoal:{digits}:hb:w1", "1", px=5000)
        w.xadd("shoal:{digits}:events", {"data": "{}"})
        w.rpush("shoal:{digits}:join:1", "ok")
        w.zadd("shoal:{digits}:last_seen", {"w1": 1})
        script = w.register_script("return redis.call('GET', KEYS[1])")
        assert script(keys=["shoal:{digits}:hb:w1"]) == b"1"
        assert list(w.scan_iter(match="shoal:{digits}:rdzv:*")) == []
        assert w.time()
        # everything else is refused
        denied = [
            lambda: w.get("shoal:{other}:spec"),
            lambda: w.set("shoal:jobs", "x"),
            lambda: w.set("rq:queue:shoal-launch", "x"),
            lambda: script(keys=["shoal:{other}:spec"]),
            lambda: w.flushall(),
            lambda: w.flushdb(),
            lambda: w.config_get("requirepass"),
            lambda: w.config_set("appendonly", "no"),
            lambda: w.keys("*"),
            lambda: w.publish("shoal", "x"),
            lambda: w.acl_list(),
            lambda: w.shutdown(),
        ]
        for i, call in enumerate(denied):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        assert admin.get("shoal:{other}:spec") == b"x"
    finally:
        server.stop()
