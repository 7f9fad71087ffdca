"""The deployment files: compose.yaml, compose.ha.yaml (Redis under Sentinel), Dockerfile,
deploy/ (env, redis.conf, ACL recipe, scripts).

Plain-YAML tests always run. ``docker-compose config`` (or ``docker compose config``) runs when
the tool exists; otherwise those tests are skipped with the reason. The Redis config and the
ACL recipe are exercised against the embedded Redis-compatible server (valkey) shipped with
the project, and so is deploy/redis-ha.sh: it forms a Sentinel set (a primary, 2 replicas, 3
sentinels) that fails over and whose members come back in their roles.
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
HA_COMPOSE = ROOT / "compose.ha.yaml"
DEPLOY = ROOT / "deploy"

SECRETS = ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY")
SERVICES = {"redis", "minio", "minio-init", "coordinator-a", "coordinator-b", "agent", "submit", "preflight", "api"}
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
    # stopped before the coordinators, so that `docker compose down` drains the agents' workers
    # (found by scripts/compose_check.py, scenario down-up: stopped together, the agents were
    # killed at the stop timeout, exit 137, their workers declared failed)
    for coordinator in ("coordinator-a", "coordinator-b"):
        assert services["agent"]["depends_on"][coordinator]["condition"] == "service_started"
    # and before the checkpoint store: the last worker to drain checkpoints the step it reached
    # (scenario down-up: minio stopped with the agents, the save failed, 35 steps were redone)
    assert services["agent"]["depends_on"]["minio"]["condition"] == "service_healthy"
    # --if-absent: the one-shot runs on every `up`; a later one leaves the job it registered as
    # it is, exit 0 (found by scripts/compose_check.py, scenario down-up: it exited 2)
    assert command_list(services["submit"]) == ["shoal", "submit", "examples/job-s3.yaml", "--if-absent"]
    assert services["submit"].get("restart") == "no"
    assert services["minio-init"]["image"].startswith("minio/mc")
    # the HTTP API and dashboard (found missing by scripts/compose_check.py, scenario api): on
    # loopback only, with a liveness healthcheck that never asks Redis
    assert command_list(services["api"]) == ["shoal", "serve", "--host", "0.0.0.0", "--port", "8080"]
    assert [p for _host, p in published_ports(services["api"])] == ["8080"]
    assert "/health/live" in " ".join(command_list({"command": services["api"]["healthcheck"]["test"]}))
    assert services["api"].get("restart") == "unless-stopped"
    for name in ("coordinator-a", "coordinator-b", "agent", "submit", "api"):
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
    # torch alone from the index the build argument names, the CPU build's by default; the
    # project and its other dependencies from pip's own index (no other index in the file)
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in code
    install = 'RUN pip install --index-url "${TORCH_INDEX}" torch==2.13.0'
    assert install in code and code.index("ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu") < code.index(install)
    assert [line for line in lines if "index-url" in line] == [install] and "find-links" not in "".join(lines)
    assert any(line.startswith("RUN pip install .") for line in code)
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


def run_config(tmp_path: Path, env_values: dict[str, str], files: tuple[Path, ...] = (COMPOSE,)) -> subprocess.CompletedProcess:
    tool = compose_tool()
    if tool is None:
        pytest.skip("neither docker-compose nor `docker compose` is installed (apt-get install docker-compose)")
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env_values.items()))
    # the caller's environment must not supply (or override) the credentials under test
    env = {k: v for k, v in os.environ.items() if k not in SECRETS and k != "S3_ENDPOINT"}
    return subprocess.run(
        [*tool, "--env-file", str(env_file), *(a for f in files for a in ("-f", str(f))), "config"],
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


# --- compose.ha.yaml: Redis under Sentinel ------------------------------------------------------

DATA_NODES = ("redis", "redis-1", "redis-2")  # the initial primary first
SENTINEL_SERVICES = ("sentinel-0", "sentinel-1", "sentinel-2")
SHOAL_SERVICES = ("coordinator-a", "coordinator-b", "agent", "submit", "api")
HA_URL = "redis+sentinel://default:{pw}@sentinel-0:26379,sentinel-1:26379,sentinel-2:26379/shoal/0"


def ha_source() -> dict:
    return yaml.safe_load(HA_COMPOSE.read_text())


def env_of(service: dict) -> dict:
    env = service.get("environment") or {}
    return dict(e.split("=", 1) for e in env) if isinstance(env, list) else env


def sentinel_url_parts(url: str) -> tuple[str, list[tuple[str, int]]]:
    """(service, sentinels) of a redis+sentinel:// URL, as shoal's client reads it (nothing dialled)."""
    from shoal.core.connection import connect

    pool = connect(url, check=False).connection_pool
    return pool.service_name, [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
                               for s in pool.sentinel_manager.sentinels]


def check_ha_invariants(services: dict, base: dict) -> None:
    """What must hold in the merged (compose.yaml + compose.ha.yaml) config: 1 primary and 2
    replicas, 3 sentinels (quorum 2, down-after 1000 ms, failover-timeout 3000 ms), each
    member announcing its service name, with its own volume and the image the single Redis
    used; every shoal service on the sentinels' URL, waiting for them to be healthy."""
    members = {name: command_list(svc) for name, svc in services.items()
               if command_list(svc)[:2] == ["sh", "/shoal-deploy/redis-ha.sh"]}
    assert sorted(n for n, cmd in members.items() if cmd[2:] == ["server"]) == sorted(DATA_NODES)
    assert sorted(n for n, cmd in members.items() if cmd[2:] == ["sentinel"]) == sorted(SENTINEL_SERVICES)
    data_volumes = set()
    for name in members:
        svc = services[name]
        env = env_of(svc)
        assert svc["image"] == base["services"]["redis"]["image"], name
        assert env["SHOAL_ANNOUNCE_HOST"] == name
        assert env["SHOAL_REDIS_NODES"].split() == [f"{n}:6379" for n in DATA_NODES], name
        assert env["SHOAL_SENTINELS"].split() == [f"{n}:26379" for n in SENTINEL_SERVICES], name
        assert env.get("SHOAL_REDIS_SERVICE", "shoal") == "shoal"
        assert svc.get("healthcheck") and svc.get("restart") == "unless-stopped", name
        volumes = [v if isinstance(v, str) else f"{v.get('source')}:{v['target']}" for v in svc.get("volumes", [])]
        assert any(v.split(":")[1] == "/shoal-deploy/redis-ha.sh" and v.split(":")[0].endswith("deploy/redis-ha.sh")
                   for v in volumes), (name, volumes)
        data = [v.split(":")[0] for v in volumes if v.split(":")[1] == "/data"]
        assert len(data) == 1 and data[0] not in data_volumes, (name, volumes)  # state of its own
        data_volumes.add(data[0])
        if name in SENTINEL_SERVICES:
            assert (env["SHOAL_SENTINEL_QUORUM"], env["SHOAL_SENTINEL_DOWN_AFTER_MS"],
                    env["SHOAL_SENTINEL_FAILOVER_TIMEOUT_MS"]) == ("2", "1000", "3000")
    for name, svc in services.items():
        for host, published in published_ports(svc):
            assert host == "127.0.0.1", f"{name} publishes port {published} on {host or 'every interface'}"
    shoal = [name for name, svc in base["services"].items() if svc.get("image") == "shoal:local"]
    assert sorted(shoal) == sorted(SHOAL_SERVICES)
    for name in shoal:
        url = env_of(services[name])["REDIS_URL"]
        service, sentinels = sentinel_url_parts(_INTERP.sub("pw", url))
        assert service == "shoal" and sentinels == [(n, 26379) for n in SENTINEL_SERVICES], (name, url)
        for sentinel in SENTINEL_SERVICES:
            assert services[name]["depends_on"][sentinel]["condition"] == "service_healthy", name


def test_ha_compose_source() -> None:
    ha, base = ha_source(), compose_source()
    assert set(ha["services"]) == {*DATA_NODES, *SENTINEL_SERVICES, *SHOAL_SERVICES}
    assert set(ha["services"]) - set(base["services"]) == {"redis-1", "redis-2", *SENTINEL_SERVICES}
    for name in SHOAL_SERVICES:  # compose.yaml keeps the single-Redis URL; the override replaces it
        url = ha["services"][name]["environment"]["REDIS_URL"]
        assert url == HA_URL.format(pw="${REDIS_PASSWORD:?set REDIS_PASSWORD in .env}"), name
    merged = {name: {**base["services"].get(name, {}), **svc,
                     "environment": {**env_of(base["services"].get(name, {})), **env_of(svc)},
                     "volumes": [*svc.get("volumes", []), *base["services"].get(name, {}).get("volumes", [])],
                     "depends_on": {**base["services"].get(name, {}).get("depends_on", {}), **svc.get("depends_on", {})}}
              for name, svc in ha["services"].items()}
    check_ha_invariants(merged, base)
    for name, svc in ha["services"].items():
        assert "ports" not in svc, f"{name}: no port of the Sentinel set is published"


def test_no_credential_literal_in_ha_compose() -> None:
    text = HA_COMPOSE.read_text()
    secretish = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN|AUTH", re.I)
    for name, svc in ha_source()["services"].items():
        for key, value in env_of(svc).items():
            if secretish.search(key):
                assert _INTERP.fullmatch(str(value)), f"{name}.environment.{key} is not a ${{...}} reference"
    refs = re.findall(r"\$\{(REDIS_PASSWORD|S3_ACCESS_KEY|S3_SECRET_KEY)([^}]*)\}", text)
    assert refs and {n for n, _ in refs} == {"REDIS_PASSWORD"}
    assert all(rest == ":?set REDIS_PASSWORD in .env" for _n, rest in refs), refs
    for line in (DEPLOY / "env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert line.split("=", 1)[1] not in text


def test_ha_compose_config_renders(tmp_path: Path) -> None:
    res = run_config(tmp_path, TEST_ENV, (COMPOSE, HA_COMPOSE))
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    check_ha_invariants(services, compose_source())
    pw = TEST_ENV["REDIS_PASSWORD"]
    for name in SHOAL_SERVICES:
        assert services[name]["environment"]["REDIS_URL"] == HA_URL.format(pw=pw)
        assert services[name]["environment"]["S3_SECRET_KEY"] == TEST_ENV["S3_SECRET_KEY"]
    for name in (*DATA_NODES, *SENTINEL_SERVICES):
        assert services[name]["environment"]["REDIS_PASSWORD"] == services[name]["environment"]["REDISCLI_AUTH"] == pw


def test_ha_compose_refuses_to_start_without_the_redis_password(tmp_path: Path) -> None:
    res = run_config(tmp_path, {k: v for k, v in TEST_ENV.items() if k != "REDIS_PASSWORD"}, (COMPOSE, HA_COMPOSE))
    assert res.returncode != 0
    assert "set REDIS_PASSWORD in .env" in res.stderr + res.stdout


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


# --- deploy/redis-ha.sh: a Sentinel set of real servers -------------------------------------------


class HAMembers:
    """Members of a Sentinel set started the way compose.ha.yaml and deploy/k8s start them
    (``sh deploy/redis-ha.sh server|sentinel``), on loopback with free ports, with the
    embedded server's binaries in place of the image's redis-server and redis-cli."""

    def __init__(self, tmp: Path) -> None:
        cli = server_binary().with_name("valkey-cli")
        if not cli.exists():
            pytest.skip(f"no valkey-cli beside {server_binary()}")
        self.tmp = tmp
        self.pw = TEST_ENV["REDIS_PASSWORD"]
        self.ports = {**{f"node{i}": free_port() for i in range(3)}, **{f"sentinel{i}": free_port() for i in range(3)}}
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "REDIS_PASSWORD": self.pw,
            "REDIS_SERVER": str(server_binary()), "REDIS_CLI": str(cli), "SHOAL_BIND": "127.0.0.1",
            "SHOAL_ANNOUNCE_HOST": "127.0.0.1", "SHOAL_REDIS_CONF": str(DEPLOY / "redis.conf"),
            "SHOAL_REDIS_NODES": " ".join(f"127.0.0.1:{self.ports[f'node{i}']}" for i in range(3)),
            "SHOAL_SENTINELS": " ".join(f"127.0.0.1:{self.ports[f'sentinel{i}']}" for i in range(3)),
        }
        self.url = (f"redis+sentinel://default:{self.pw}@"
                    + ",".join(f"127.0.0.1:{self.ports[f'sentinel{i}']}" for i in range(3)) + "/shoal/0")

    def start(self, name: str, *, fresh: bool = False, refused: bool = False) -> None:
        """Start ``name`` and wait until it answers (``refused``: until it exits 1 instead)."""
        state = self.tmp / name
        if fresh:
            shutil.rmtree(state, ignore_errors=True)
        state.mkdir(exist_ok=True)
        env = {**self.env, "SHOAL_PORT": str(self.ports[name]), "SHOAL_STATE_DIR": str(state)}
        with open(self.tmp / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                ["sh", str(DEPLOY / "redis-ha.sh"), "server" if name.startswith("node") else "sentinel"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if refused:
            assert self.procs.pop(name).wait(30) == 1, self.log(name)
            return
        wait_until(lambda: self._answers(name), 15, lambda: f"{name} to answer: {self.log(name)}")

    def stop(self, name: str, *, kill: bool = False) -> None:
        proc = self.procs.pop(name)
        proc.kill() if kill else proc.terminate()
        proc.wait(15)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name, kill=True)

    def client(self, name: str) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[name], password=self.pw, socket_timeout=2,
                           retry=Retry(NoBackoff(), 0))

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-800:] if path.exists() else ""

    def _answers(self, name: str) -> bool:
        assert self.procs[name].poll() is None, f"{name} exited: {self.log(name)}"
        try:
            return bool(self.client(name).ping())
        except redis.ConnectionError:
            return False

    def replication(self, name: str) -> dict:
        try:
            return self.client(name).info("replication")
        except redis.RedisError:
            return {}

    def primary_port(self, sentinel: str) -> int | None:
        try:
            return int(self.client(sentinel).sentinel_get_master_addr_by_name("shoal")[1])
        except (redis.RedisError, TypeError):
            return None

    def conf(self, name: str) -> list[str]:
        return (self.tmp / name / "redis-ha.conf").read_text().splitlines()


@pytest.mark.slow
def test_redis_ha_script_forms_a_sentinel_set_that_fails_over_and_keeps_roles(tmp_path: Path) -> None:
    """deploy/redis-ha.sh with the embedded server: the set forms (shoal's `health redis` view:
    2 replicas in sync, 3 sentinels, quorum 2), also when a replica starts before the initial
    primary (compose starts them together); after a kill -9 of the primary a replica is
    promoted and the Redis config files record the new roles; a restarted replica comes back
    as a replica of the new primary; a sentinel and a data node that lost their state learn
    the current primary from the others instead of taking the initial one; and a primary that
    lost its state while no sentinel answers does not start empty under replicas with data."""
    from shoal.core.connection import connect
    from shoal.ops.health import check_redis

    ha = HAMembers(tmp_path)
    try:
        for name in ("node1", "node0", "node2", "sentinel0", "sentinel1", "sentinel2"):
            ha.start(name)
        assert "starting as the primary" in (tmp_path / "node0.log").read_text()
        assert not any(line.startswith("replicaof") for line in ha.conf("node0"))
        p0 = ha.ports["node0"]
        assert f"replicaof 127.0.0.1 {p0}" in ha.conf("node1") and f"replicaof 127.0.0.1 {p0}" in ha.conf("node2")

        def healthy() -> str | None:
            try:
                verdict = check_redis(connect(ha.url, timeout=2))
            except Exception:  # noqa: BLE001 (not formed yet)
                return None
            return verdict.reason if verdict.healthy and "3 of 3 sentinel(s) answer" in verdict.reason \
                and "2 replica(s) in sync" in verdict.reason else None

        reason = wait_until(healthy, 30, lambda: f"the set to form: {ha.log('sentinel0')}")

        def sentinels_know_all() -> bool:  # a replica the sentinels do not know is not moved in a fail-over
            try:
                views = [ha.client(f"sentinel{i}").sentinel_master("shoal") for i in range(3)]
            except redis.RedisError:
                return False
            return all(int(v["num-slaves"]) == 2 and int(v["num-other-sentinels"]) == 2 for v in views)

        wait_until(sentinels_know_all, 30, lambda: f"the sentinels to know the set: {ha.log('sentinel0')}")
        assert f"primary 127.0.0.1:{p0}" in reason and "quorum 2" in reason
        client = connect(ha.url)
        client.set("shoal:test", "before")
        assert client.execute_command("WAIT", 2, 2000) == 2
        password_free = [ha.log(n) for n in ha.procs]

        ha.stop("node0", kill=True)
        new = wait_until(lambda: (p := ha.primary_port("sentinel1")) not in (None, p0) and p, 30,
                         lambda: f"a promotion: {ha.log('sentinel1')}")
        promoted = next(n for n in ("node1", "node2") if ha.ports[n] == new)
        other = next(n for n in ("node1", "node2") if n != promoted)

        def write() -> bool:
            try:
                return bool(client.set("shoal:test", "after"))
            except redis.RedisError:  # the sentinels do not all name the new primary yet
                return False

        wait_until(write, 30, "a write through the sentinels")
        # Sentinel's CONFIG REWRITE keeps the roles in the files the members restart from
        wait_until(lambda: not any(line.startswith("replicaof") for line in ha.conf(promoted))
                   and f"replicaof 127.0.0.1 {new}" in ha.conf(other), 30, lambda: f"{ha.conf(other)}")

        ha.stop(other)
        ha.start(other)
        wait_until(lambda: ha.replication(other).get("master_port") == new
                   and ha.replication(other).get("master_link_status") == "up", 30,
                   lambda: f"{other} back as a replica of {new}: {ha.log(other)}")

        ha.stop("sentinel2", kill=True)
        ha.start("sentinel2", fresh=True)
        assert ha.primary_port("sentinel2") == new, ha.log("sentinel2")
        ha.start("node0", fresh=True)  # the old primary, its volume lost: a replica of the new one
        wait_until(lambda: ha.replication("node0").get("master_port") == new
                   and ha.replication("node0").get("master_link_status") == "up", 30,
                   lambda: f"node0 as a replica of {new}: {ha.log('node0')}")
        assert ha.client("node0").get("shoal:test") == b"after"
        assert f"starting as a replica of 127.0.0.1:{new} (sentinels)" in (tmp_path / "node0.log").read_text()
        assert all(ha.pw not in text for text in password_free)

        # no sentinel answers, and the primary comes back without its state: its replicas hold
        # data, so it refuses to start as an empty primary (they would drop their copy)
        for name in ("sentinel0", "sentinel1", "sentinel2"):
            ha.stop(name)
        ha.stop(promoted, kill=True)
        ha.start(promoted, fresh=True, refused=True)
        assert "not starting as an empty primary" in ha.log(promoted)
        assert ha.client(other).get("shoal:test") == b"after"
    finally:
        ha.stop_all()
