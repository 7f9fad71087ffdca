"""The Kubernetes manifests (deploy/k8s): each overlay renders with kustomize (the
``kustomize`` binary, or kubectl's built-in one when it is kustomize v4 or newer; skipped with
the reason when neither exists), every rendered object validates strictly against the
Kubernetes OpenAPI schemas (``kubernetes-validate``, offline), and the deployment rules hold:
no credential in any file (the one Secret is a template of placeholders, not rendered),
requests/limits on every container, probes on every long-running one, no ServiceAccount
token mounted and no API permission granted, restricted security contexts, every command of
the shoal image a valid ``shoal`` command line (parsed with the CLI's own parser), every
``$(VAR)``, Secret key, ConfigMap, ServiceAccount, Service selector and probe port resolving,
two coordinator replicas, and the copies of deploy/ scripts identical to the originals.
The overlays with the ``redis-sentinel`` component (prod, ha) run Redis under Sentinel: one
primary and 2 replicas, 3 sentinels with quorum 2, every shoal pod on a ``redis+sentinel://``
URL naming those sentinels, and ``deploy/redis-ha.sh`` given the environment of each member
writes the config and command line the topology needs.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shoal.ops.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
#: Oldest Kubernetes release the manifests are meant for, and the newest the validator knows.
K8S_VERSIONS = ("1.29.0", None)
SECRET_NAME = "shoal-credentials"
PLACEHOLDER = re.compile(r"^change-me[-a-z0-9]*$")
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _kustomize_cmd() -> list[str] | None:
    """A command that renders a kustomization directory given as its last argument."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"Kustomize Version: v(\d+)", out)
        if m and int(m.group(1)) >= 4:  # kubectl <= 1.20 embeds kustomize v2: too old for `patches`
            return ["kubectl", "kustomize"]
    return None


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    cmd = _kustomize_cmd()
    if cmd is None:
        pytest.skip("no kustomize: neither a `kustomize` binary nor kubectl with kustomize v4+ on PATH")
    proc = subprocess.run([*cmd, str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kustomize build {overlay} failed: {proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def pod_specs(objs) -> list[tuple[dict, dict]]:
    """(workload, pod spec) of every workload."""
    return [(o, o["spec"]["template"]["spec"]) for o in objs if o["kind"] in WORKLOADS]


def containers(spec: dict, *, init: bool = True) -> list[dict]:
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def named(o: dict) -> str:
    return f"{o['kind']}/{o['metadata']['name']}"


def source_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


def _includes_sentinel(overlay: str) -> bool:
    k = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    if any(c.rstrip("/").endswith("components/redis-sentinel") for c in k.get("components", [])):
        return True
    return any(_includes_sentinel(Path(r).name) for r in k.get("resources", []) if r.startswith("../") and
               (K8S / "overlays" / Path(r).name / "kustomization.yaml").exists())


#: the overlays with Redis under Sentinel (components/redis-sentinel), and those without
HA_OVERLAYS = [o for o in OVERLAYS if _includes_sentinel(o)]
SINGLE_OVERLAYS = [o for o in OVERLAYS if o not in HA_OVERLAYS]
SENTINEL_SERVICE = "shoal"


def sentinel_hosts(url: str) -> list[tuple[str, int]]:
    """(host, port) of each sentinel of a ``redis+sentinel://`` URL, parsed by shoal's own
    client code (core/connection.py; nothing is dialled), which also checks the service."""
    from shoal.core.connection import connect

    client = connect(_VAR.sub("x", url), check=False)
    pool = client.connection_pool
    assert pool.service_name == SENTINEL_SERVICE, url
    return [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in pool.sentinel_manager.sentinels]


def stateful_pod(objs, host: str) -> tuple[dict, dict]:
    """The StatefulSet and governing Service behind the pod DNS name ``<sts>-<i>.<service>``."""
    m = re.fullmatch(r"(.+)-(\d+)\.([a-z0-9-]+)", host)
    assert m, f"{host} is not a StatefulSet pod's stable name <statefulset>-<i>.<service>"
    sts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "StatefulSet"}.get(m.group(1))
    assert sts, f"{host}: no StatefulSet {m.group(1)}"
    assert int(m.group(2)) < sts["spec"]["replicas"], f"{host}: {named(sts)} has {sts['spec']['replicas']} pods"
    assert sts["spec"]["serviceName"] == m.group(3), f"{host}: {named(sts)} is governed by {sts['spec']['serviceName']}"
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == m.group(3))
    return sts, svc


def pod_env(container: dict, pod_name: str, secrets: dict[str, str]) -> dict[str, str]:
    """The environment the kubelet gives ``container`` of pod ``pod_name``: ``$(VAR)`` expanded
    from the variables before it, fieldRef metadata.name, and ``secrets`` for secretKeyRefs."""
    import os

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e["valueFrom"]:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
            env[e["name"]] = pod_name
        else:
            env[e["name"]] = secrets[e["valueFrom"]["secretKeyRef"]["key"]]
    return env


@pytest.fixture(params=OVERLAYS)
def objs(request) -> tuple[dict, ...]:
    return render(request.param)


def test_overlays_exist_and_render():
    assert {"dev", "prod", "ha"} <= set(OVERLAYS)
    for overlay in OVERLAYS:
        kinds = {o["kind"] for o in render(overlay)}
        assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "StatefulSet",
                "Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget"} <= kinds, (overlay, kinds)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_validate_against_the_kubernetes_schemas(objs, version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = version or latest_version()
    errors = []
    for o in objs:
        try:
            kubernetes_validate.validate(o, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{named(o)}: {exc.message} at {'.'.join(map(str, exc.path))}")
    assert not errors, "\n".join(errors)


def test_the_validator_catches_a_broken_manifest():
    """The check above can fail: a misspelt field and a wrong type are refused offline."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    dep = next(o for o in render("dev") if o["kind"] == "Deployment")
    for broken in ({**dep, "spec": {**dep["spec"], "replica": 2}}, {**dep, "spec": {**dep["spec"], "replicas": "two"}}):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, latest_version(), strict=True)


def test_every_secret_is_a_template_of_placeholders_and_none_is_rendered():
    secrets = []
    for path in source_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Secret":
                secrets.append((path, doc))
                assert "data" not in doc, f"{path}: base64 `data` in a Secret"
                for key, value in (doc.get("stringData") or {}).items():
                    assert PLACEHOLDER.match(str(value)), f"{path}: {key} is not a change-me placeholder"
    assert [p.name for p, _ in secrets] == ["secret.template.yaml"]
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(secrets[0][1], latest_version(), strict=True)
    for overlay in OVERLAYS:
        assert not [o for o in render(overlay) if o["kind"] == "Secret"], "a Secret is part of the rendered stack"
    kustomizations = [p for p in source_files() if p.name == "kustomization.yaml"]
    assert all("secret.template" not in p.read_text().split("resources:")[-1] for p in kustomizations)


def test_secret_references_resolve_to_template_keys(objs):
    template = yaml.safe_load((K8S / "secret.template.yaml").read_text())
    keys = set(template["stringData"])
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == SECRET_NAME and ref["key"] in keys, (named(w), c["name"], ref)
            assert not any("secretRef" in src for src in c.get("envFrom", [])), (named(w), c["name"])
    # no literal credential: the only values with the password come from $(REDIS_PASSWORD)
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            for e in c.get("env", []):
                if "value" in e and e["name"] in keys:
                    pytest.fail(f"{named(w)}/{c['name']}: {e['name']} has a literal value")


def test_every_container_has_requests_and_limits(objs):
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            res = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), f"{named(w)}/{c['name']}: no {kind}"


def test_every_long_running_container_has_probes(objs):
    """Deployments and StatefulSets: liveness and readiness (and a startup probe, so a slow
    start is not taken for a hang). One-shot Jobs and init containers run to completion."""
    for w, spec in pod_specs(objs):
        if w["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in containers(spec, init=False):
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                assert probe in c, f"{named(w)}/{c['name']}: no {probe}"
                assert c[probe].get("timeoutSeconds", 1) >= 1


def test_no_service_account_token_and_no_api_permissions(objs):
    accounts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceAccount"}
    assert accounts and all(sa.get("automountServiceAccountToken") is False for sa in accounts.values())
    for w, spec in pod_specs(objs):
        assert spec.get("automountServiceAccountToken") is False, named(w)
        assert spec.get("serviceAccountName") in accounts, named(w)  # never the namespace's `default`
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    for role in (o for o in objs if o["kind"] == "Role"):
        assert role.get("rules") == [], f"{named(role)} grants {role['rules']}"


def test_restricted_security_contexts(objs):
    namespace = next(o for o in objs if o["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    ns = namespace["metadata"]["name"]
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == ns, named(o)
    for w, spec in pod_specs(objs):
        sc = spec.get("securityContext", {})
        assert sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) > 0, named(w)
        assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", named(w)
        assert not spec.get("hostNetwork") and not spec.get("hostPID"), named(w)
        for c in containers(spec):
            csc = c.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, (named(w), c["name"])
            assert csc.get("readOnlyRootFilesystem") is True, (named(w), c["name"])
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], (named(w), c["name"])
            assert not csc.get("privileged"), (named(w), c["name"])


def _shoal_argvs(objs) -> list[tuple[str, list[str], dict]]:
    """(where, argv, container) of every command run from the shoal image: the containers'
    commands and their exec probes."""
    out = []
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            argv = list(c.get("command", [])) + list(c.get("args", []))
            if not argv or argv[0] != "shoal":
                continue
            out.append((f"{named(w)}/{c['name']}", argv, c))
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                cmd = c.get(probe, {}).get("exec", {}).get("command")
                if cmd:
                    assert cmd[0] == "shoal", (named(w), probe, cmd)
                    out.append((f"{named(w)}/{c['name']} {probe}", cmd, c))
    return out


def _parse(argv: list[str]):
    """The CLI's own parser on ``argv`` (without ``shoal``); AssertionError naming the cause."""
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{' '.join(argv)}` is not a valid shoal command line (exit {exc.code})") from None


def test_shoal_commands_parse_with_the_cli_parser(objs):
    known = set(build_parser()._subparsers._group_actions[0].choices)  # noqa: SLF001 (argparse has no API)
    seen = set()
    for where, argv, c in _shoal_argvs(objs):
        assert c["image"] != "shoal" and "shoal" in c["image"], f"{where}: image {c['image']} not set by the overlay"
        env = {e["name"] for e in c.get("env", [])}
        for var in _VAR.findall(" ".join(argv)):
            assert var in env, f"{where}: $({var}) is not an env var of the container (the kubelet would pass it literally)"
        if argv[1] not in known:
            assert argv[1] == "serve", f"{where}: `shoal {argv[1]}` is no shoal command"
            continue  # `shoal serve` comes with the HTTP API; parsed by the test below once it exists
        args = _parse([a if not _VAR.search(a) else _VAR.sub("x", a) for a in argv])
        seen.add(args.command)
        if args.command == "health":
            assert args.component in ("coordinator", "agent")
    assert {"coordinator", "agent", "submit", "health"} <= seen


def test_shoal_serve_command_parses_once_serve_exists():
    if "serve" not in build_parser()._subparsers._group_actions[0].choices:  # noqa: SLF001
        pytest.skip("`shoal serve` is not in this tree's CLI yet (it comes with the HTTP API)")
    for overlay in OVERLAYS:
        argvs = [argv for _w, argv, _c in _shoal_argvs(render(overlay)) if argv[1] == "serve"]
        assert argvs
        for argv in argvs:
            _parse(argv)


def test_health_probes_match_what_the_processes_run(objs):
    """The coordinator's probes use its lease TTL; its --id is the pod name (the host name,
    the probe's default); the agent's probes allow more than its heartbeat interval."""
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    coord = deps["shoal-coordinator"]["spec"]["template"]["spec"]["containers"][0]
    run = _parse(coord["command"])
    assert run.id == "$(POD_NAME)" or _VAR.fullmatch(coord["command"][coord["command"].index("--id") + 1])
    pod_name = next(e for e in coord["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    agent = deps["shoal-agent"]["spec"]["template"]["spec"]["containers"][0]
    heartbeat = _parse(agent["command"]).heartbeat
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        check = _parse(coord[probe]["exec"]["command"])
        assert check.lease_ttl == run.lease_ttl and check.id is None
        agent_check = _parse(agent[probe]["exec"]["command"])
        assert agent_check.max_age >= 2 * heartbeat
        # a Redis outage must not restart the processes: liveness and startup pass it
        assert agent_check.allow_redis_down == check.allow_redis_down == (probe != "readinessProbe")
    serve = deps["shoal-serve"]["spec"]["template"]["spec"]["containers"][0]
    # the API: ready while Redis answers (/health is 503 otherwise), alive while it serves
    assert serve["readinessProbe"]["httpGet"]["path"] == "/health"
    assert serve["livenessProbe"]["httpGet"]["path"] == serve["startupProbe"]["httpGet"]["path"] == "/health/live"


def test_coordinators_are_two_replicas_and_agents_scale_per_overlay():
    for overlay in OVERLAYS:
        deps = {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == "Deployment"}
        assert deps["shoal-coordinator"]["spec"]["replicas"] == 2, overlay
    agents = {o: next(d for d in render(o) if d["metadata"]["name"] == "shoal-agent") for o in ("dev", "prod")}
    assert agents["dev"]["spec"]["replicas"] == 1
    assert agents["prod"]["spec"]["replicas"] > 1
    gpu = agents["prod"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == 1


def test_references_resolve(objs):
    """ConfigMaps, Services' selectors, probe ports, the StatefulSets' governing Services and
    the REDIS_URL host all point at objects of the rendered stack."""
    by_kind: dict[str, dict[str, dict]] = {}
    for o in objs:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    pods = pod_specs(objs)
    for w, spec in pods:
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in by_kind["ConfigMap"], (named(w), v)
        for c in containers(spec):
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in by_kind["ConfigMap"], (named(w), src)
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {
                t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}, (named(w), mounts)
            ports = {p.get("name") for p in c.get("ports", [])} | {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                assert port is None or port in ports, (named(w), probe, port)
            for e in c.get("env", []):
                if e["name"] == "REDIS_URL" and e["value"].startswith("redis+sentinel://"):
                    for host, port in sentinel_hosts(e["value"]):
                        pod, svc = stateful_pod(objs, host)
                        assert svc["spec"]["clusterIP"] == "None", (named(w), host)
                        assert port in [p["port"] for p in svc["spec"]["ports"]], (named(w), host, port)
                elif e["name"] == "REDIS_URL":
                    host = re.match(r"^redis://[^@]+@([^:/]+):(\d+)/\d+$", e["value"])
                    assert host and host.group(1) in by_kind["Service"], e["value"]
    for svc in by_kind["Service"].values():
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= w["spec"]["template"]["metadata"]["labels"].items() for w, _s in pods), named(svc)
    for sts in by_kind["StatefulSet"].values():
        assert by_kind["Service"][sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"


def test_configmap_copies_equal_the_compose_files():
    cms = {o["metadata"]["name"]: o for o in render(OVERLAYS[0]) if o["kind"] == "ConfigMap"}
    deploy = ROOT / "deploy"
    for overlay in HA_OVERLAYS:
        ha = {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == "ConfigMap"}
        assert ha["redis-ha-scripts"]["data"]["redis-ha.sh"] == (deploy / "redis-ha.sh").read_text(), overlay
    assert cms["redis-conf"]["data"]["redis.conf"] == (deploy / "redis.conf").read_text()
    assert cms["shoal-deploy-scripts"]["data"]["preflight.sh"] == (deploy / "preflight.sh").read_text()
    assert cms["shoal-deploy-scripts"]["data"]["minio-init.sh"] == (deploy / "minio-init.sh").read_text()
    assert cms["shoal-job"]["data"]["job.yaml"] == (ROOT / "examples" / "job-s3.yaml").read_text()


def test_submitted_spec_is_a_valid_job_spec(tmp_path):
    """The ConfigMap's job spec loads with the CLI's own spec loader."""
    from shoal.core.jobspec import load_spec

    cm = next(o for o in render(OVERLAYS[0]) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "shoal-job")
    path = tmp_path / "job.yaml"
    path.write_text(cm["data"]["job.yaml"])
    spec = load_spec(path)
    assert spec.checkpoint_uri.startswith("s3://shoal-checkpoints/")


def test_preflight_init_container_refuses_the_secret_template(tmp_path):
    """The init container's own command and environment, with the template's placeholder
    values for its secretKeyRefs: it refuses them, naming the Secret (never a value); with
    real values it passes."""
    import os

    template = yaml.safe_load((K8S / "secret.template.yaml").read_text())["stringData"]
    sts = next(o for o in render(OVERLAYS[0]) if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "redis")
    init = sts["spec"]["template"]["spec"]["initContainers"][0]
    cm = next(o for o in render(OVERLAYS[0]) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "shoal-deploy-scripts")
    (tmp_path / "preflight.sh").write_text(cm["data"]["preflight.sh"])
    argv = [tmp_path / "preflight.sh" if a == "/shoal-deploy/preflight.sh" else a for a in init["command"]]

    def run(values: dict[str, str]) -> subprocess.CompletedProcess:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for e in init["env"]:
            env[e["name"]] = e["value"] if "value" in e else values[e["valueFrom"]["secretKeyRef"]["key"]]
        return subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=30)

    refused = run(template)
    assert refused.returncode == 1
    for name in ("REDIS_PASSWORD", "S3_ACCESS_KEY", "S3_SECRET_KEY"):
        assert f"shoal: {name} in the Secret shoal-credentials is still the placeholder from " \
               "deploy/k8s/secret.template.yaml" in refused.stderr
    assert ".env" not in refused.stderr and "change-me" not in refused.stderr.replace("secret.template", "")
    real = {"REDIS_PASSWORD": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "S3_ACCESS_KEY": "shoal-1a2b",
            "S3_SECRET_KEY": "9f8e7d6c5b4a3928", "SHOAL_API_TOKEN": "t" * 32}
    ok = run(real)
    assert ok.returncode == 0, ok.stderr
    assert all(v not in ok.stdout + ok.stderr for v in real.values())


def test_env_references_name_earlier_variables(objs):
    """The kubelet expands ``$(VAR)`` in an env value only from variables defined before it
    in the same container (envFrom first); a later or unknown one stays literal, which for
    REDIS_URL would send the text ``$(REDIS_PASSWORD)`` as the password."""
    cms = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            defined = {k for src in c.get("envFrom", []) for k in cms[src["configMapRef"]["name"]]["data"]}
            for e in c.get("env", []):
                for var in _VAR.findall(e.get("value", "")):
                    assert var in defined, f"{named(w)}/{c['name']}: {e['name']} uses $({var}) before it is defined"
                defined.add(e["name"])


# --- Redis under Sentinel (components/redis-sentinel) -------------------------------------------

TEST_SECRETS = {"REDIS_PASSWORD": "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "S3_ACCESS_KEY": "shoal-1a2b",
                "S3_SECRET_KEY": "9f8e7d6c5b4a3928", "SHOAL_API_TOKEN": "t" * 32}
SHOAL_WORKLOADS = {"shoal-coordinator", "shoal-agent", "shoal-serve", "shoal-submit"}


def _workloads(objs, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _shoal_redis_urls(objs) -> dict[str, str]:
    """workload/container -> REDIS_URL of every container that runs shoal."""
    out = {}
    for w, spec in pod_specs(objs):
        for c in containers(spec):
            if (c.get("command") or [""])[0] == "shoal":
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                out[f"{w['metadata']['name']}/{c['name']}"] = env.get("REDIS_URL")
    return out


def test_which_overlays_run_redis_under_sentinel():
    """dev keeps the single Redis; prod and ha run the Sentinel set."""
    assert "dev" in SINGLE_OVERLAYS and {"prod", "ha"} <= set(HA_OVERLAYS)
    for overlay in SINGLE_OVERLAYS:
        objs = render(overlay)
        sts = _workloads(objs, "StatefulSet")
        assert sts["redis"]["spec"]["replicas"] == 1 and "redis-sentinel" not in sts, overlay
        urls = _shoal_redis_urls(objs)
        assert {k.split("/")[0] for k in urls} == SHOAL_WORKLOADS
        assert all(u.startswith("redis://") for u in urls.values()), (overlay, urls)


@pytest.mark.parametrize("overlay", HA_OVERLAYS)
def test_sentinel_topology(overlay):
    """A primary and 2 replicas (the StatefulSet `redis`), 3 sentinels with quorum 2, every
    shoal pod on the same redis+sentinel:// URL of service `shoal` naming the 3 sentinels by
    their stable names, no Service that could route a client to a replica, stable names
    that resolve before the pods are ready, and the sentinel's config on a writable volume."""
    objs = render(overlay)
    sts = _workloads(objs, "StatefulSet")
    services = _workloads(objs, "Service")
    redis, sentinel = sts["redis"], sts["redis-sentinel"]
    assert redis["spec"]["replicas"] == 3 and sentinel["spec"]["replicas"] == 3
    assert "redis" not in services, "a Service over every data node would send writes to replicas"
    for name in ("redis-headless", "redis-sentinel"):
        assert services[name]["spec"]["clusterIP"] == "None" and services[name]["spec"]["publishNotReadyAddresses"]
    assert redis["spec"]["serviceName"] == "redis-headless" and sentinel["spec"]["serviceName"] == "redis-sentinel"
    single = _workloads(render(SINGLE_OVERLAYS[0]), "StatefulSet")["redis"]["spec"]["template"]["spec"]
    base_image = containers(single, init=False)[0]["image"]  # the image the single Redis runs
    for w in (redis, sentinel):
        assert {c["image"] for c in containers(w["spec"]["template"]["spec"])} == {base_image}, named(w)

    expected = [(f"redis-sentinel-{i}.redis-sentinel", 26379) for i in range(3)]
    urls = _shoal_redis_urls(objs)
    assert {k.split("/")[0] for k in urls} == SHOAL_WORKLOADS
    assert len(set(urls.values())) == 1, urls
    url = next(iter(urls.values()))
    assert url.startswith("redis+sentinel://default:$(REDIS_PASSWORD)@") and url.endswith("/shoal/0"), url
    assert sentinel_hosts(url) == expected

    node = containers(redis["spec"]["template"]["spec"], init=False)[0]
    env = pod_env(node, "redis-1", TEST_SECRETS)
    assert env["SHOAL_REDIS_NODES"].split() == [f"redis-{i}.redis-headless:6379" for i in range(3)]
    assert env["SHOAL_SENTINELS"].split() == [f"{h}:{p}" for h, p in expected]
    assert env["SHOAL_ANNOUNCE_HOST"] == "redis-1.redis-headless"
    spec = sentinel["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "config")
    ienv = pod_env(init, "redis-sentinel-2", TEST_SECRETS)
    assert (ienv["SHOAL_SENTINEL_QUORUM"], ienv["SHOAL_SENTINEL_DOWN_AFTER_MS"],
            ienv["SHOAL_SENTINEL_FAILOVER_TIMEOUT_MS"]) == ("2", "1000", "3000")
    assert ienv["SHOAL_ANNOUNCE_HOST"] == "redis-sentinel-2.redis-sentinel"
    assert ienv["SHOAL_REDIS_NODES"] == env["SHOAL_REDIS_NODES"] and ienv["SHOAL_SENTINELS"] == env["SHOAL_SENTINELS"]
    # the init container writes the config into an emptyDir that the sentinel reads (and rewrites)
    run = containers(spec, init=False)[0]
    assert run["command"] == ["redis-server", f"{ienv['SHOAL_STATE_DIR']}/sentinel.conf", "--sentinel"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in (init, run):
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == ienv["SHOAL_STATE_DIR"])
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), c["name"]
    pdbs = _workloads(objs, "PodDisruptionBudget")
    assert pdbs["redis-sentinel"]["spec"]["maxUnavailable"] == 1  # 2 of 3 left: still a quorum
    assert pdbs["redis"]["spec"]["maxUnavailable"] == 1  # a primary and a replica left to confirm writes


def _member_script(objs, tmp_path: Path) -> tuple[Path, Path]:
    """deploy/redis-ha.sh as the pod sees it (the ConfigMap's copy) and a bin directory in
    which nobody answers redis-cli (a first start), every name resolves, and redis-server
    prints its arguments instead of serving."""
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "redis-ha-scripts")
    script = tmp_path / "redis-ha.sh"
    script.write_text(cm["data"]["redis-ha.sh"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("redis-cli", "exit 1"), ("getent", "exit 0"), ("redis-server", 'printf "%s\\n" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return script, bin_dir


@pytest.mark.parametrize("overlay", HA_OVERLAYS)
def test_sentinel_members_start_with_the_topology(overlay, tmp_path):
    """Each member's command and environment as the kubelet gives them, run through the
    ConfigMap's deploy/redis-ha.sh on a first start (no member answers yet): redis-0 starts as
    the primary, redis-1 and redis-2 as its replicas, each announcing its stable name; each
    sentinel's config monitors service `shoal` at redis-0 with quorum 2, resolves and
    announces host names, and carries the password only from the Secret."""
    objs = render(overlay)
    sts = _workloads(objs, "StatefulSet")
    pw = TEST_SECRETS["REDIS_PASSWORD"]

    script, bin_dir = _member_script(objs, tmp_path)

    def run(container: dict, pod: str, spec: dict, state: Path):
        argv = list(container["command"])
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in container["volumeMounts"]}
        assert argv[0] == "sh" and mounts[str(Path(argv[1]).parent)]["configMap"]["name"] == "redis-ha-scripts"
        env = pod_env(container, pod, TEST_SECRETS)
        env.update(PATH=f"{bin_dir}:{env['PATH']}", SHOAL_STATE_DIR=str(state))
        state.mkdir()
        res = subprocess.run(["sh", str(script), *argv[2:]], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res, env

    spec = sts["redis"]["spec"]["template"]["spec"]
    node = containers(spec, init=False)[0]
    # the settings a data node includes (when the file exists) are where the pod mounts them
    conf_volume = next(v["name"] for v in spec["volumes"] if v.get("configMap", {}).get("name") == "redis-conf")
    conf_dir = next(m["mountPath"] for m in node["volumeMounts"] if m["name"] == conf_volume)
    assert f"${{SHOAL_REDIS_CONF:-{conf_dir}/redis.conf}}" in script.read_text()
    for i in range(3):
        res, _env = run(node, f"redis-{i}", spec, tmp_path / f"redis-{i}")
        conf = (tmp_path / f"redis-{i}" / "redis-ha.conf").read_text().splitlines()
        argv = res.stdout.splitlines()
        assert argv[0] == str(tmp_path / f"redis-{i}" / "redis-ha.conf")
        replicaof = [line for line in conf if line.startswith("replicaof ")]
        assert replicaof == ([] if i == 0 else ["replicaof redis-0.redis-headless 6379"]), (i, conf)
        pairs = dict(zip(argv[1::2], argv[2::2]))
        assert pairs["--replica-announce-ip"] == f"redis-{i}.redis-headless"
        assert pairs["--requirepass"] == pairs["--masterauth"] == pw
        assert pairs["--appendonly"] == "yes" and pairs["--port"] == "6379"
        assert pairs["--repl-diskless-sync-delay"] == "0"  # a replica that needs a full copy gets it at once
        assert pw not in res.stderr

    spec = sts["redis-sentinel"]["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "config")
    for i in range(3):
        res, _env = run(init, f"redis-sentinel-{i}", spec, tmp_path / f"sentinel-{i}")
        conf = (tmp_path / f"sentinel-{i}" / "sentinel.conf").read_text().splitlines()
        for line in ("port 26379", "sentinel resolve-hostnames yes", "sentinel announce-hostnames yes",
                     f"sentinel announce-ip redis-sentinel-{i}.redis-sentinel", "sentinel announce-port 26379",
                     "sentinel monitor shoal redis-0.redis-headless 6379 2",
                     "sentinel down-after-milliseconds shoal 1000", "sentinel failover-timeout shoal 3000",
                     f"sentinel auth-pass shoal {pw}", f"requirepass {pw}"):
            assert line in conf, (line, conf)
        assert conf.index("sentinel resolve-hostnames yes") < conf.index("sentinel monitor shoal redis-0.redis-headless 6379 2")
        assert res.stdout == "" and pw not in res.stderr  # writes the config only: the sentinel container runs it
