"""Bad input at the command line: a bad job spec, a bad cluster file, an unreachable Redis
(whose password must not be printed) and an unreachable S3 endpoint each end the command
with one ``shoal: ...`` line naming the cause, a non-zero exit and no traceback."""

from __future__ import annotations

import subprocess

import pytest

from shoal.events.keys import job_keys
from shoal.ops.embedded import free_port
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from tests.helpers import run_cli as shoal

pytestmark = pytest.mark.slow


def one_line_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """The command printed exactly one line, ``shoal: ...``, on stderr (and nothing else)."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("shoal: "), res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr
    return res.stderr


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("command, body, needles", [
    ("submit", "entrypoint: simulate\nmin_workers: 3\nmax_workers: 2\n", ["min_workers (3) exceeds max_workers (2)"]),
    ("submit", "entrypoint: simulate\ncolour: red\n", ["colour: Extra inputs are not permitted"]),
    ("create", "entrypoint: simulate\nglobal_batch_size: -1\n", ["global_batch_size: Input should be greater than 0"]),
    ("create", "entrypoint: [simulate\n", ["not valid YAML at line"]),
])
def test_bad_job_spec_is_one_line_and_writes_nothing(r, cli_env, tmp_path, job_id, command, body, needles) -> None:
    spec = write(tmp_path / "job.yaml", f"name: {job_id}\n{body}")
    one_line_error(shoal(cli_env, command, spec), 2, spec, *needles)
    assert not r.exists(job_keys(job_id).spec)
    if "min_workers" in body:
        one_line_error(shoal(cli_env, "submit", str(tmp_path / "missing.yaml")), 2, "cannot read job spec", "missing.yaml")


@pytest.mark.parametrize("action, body, needles", [
    ("validate", "nodes:\n  - name: a\n    transport: ssh\n    cpu_cores: 2\n    max_workers: 1\n",
     ["nodes[a]: transport ssh needs a host"]),
    ("show", "nodes:\n  - name: a\n    transport: local\n    max_workers: 1\n    gpus:\n      - uuid: g\n        vram_mb: -5\n",
     ["nodes[a].gpus[0].vram_mb"]),
    ("validate", "nodes: [\n", ["not valid YAML"]),
    ("validate", None, ["cannot read cluster file"]),
])
def test_bad_cluster_file_is_one_line(cli_env, tmp_path, action, body, needles) -> None:
    path = write(tmp_path / "cluster.yaml", body) if body is not None else str(tmp_path / "absent.yaml")
    one_line_error(shoal(cli_env, "cluster", action, path), 2, *needles)


def test_unreachable_redis_is_one_line_without_the_password(cli_env, tmp_path) -> None:
    port = free_port()  # nothing listens there
    cli_env = {**cli_env, "REDIS_URL": f"redis://shoal:hunter2-secret@127.0.0.1:{port}/0"}
    spec = write(tmp_path / "ok.yaml", "name: fine\nentrypoint: simulate\n")
    for args in (["status", "fine"], ["submit", spec], ["stop", "fine"], ["purge", "--state", "stopped", "--yes"],
                 ["report", "fine", "-o", str(tmp_path / "r.png")], ["coordinator"]):
        res = shoal(cli_env, *args)
        err = one_line_error(res, 3, f"cannot reach Redis at redis://shoal:***@127.0.0.1:{port}/0", "Connection refused")
        assert "hunter2-secret" not in err + res.stdout, args


def test_unreachable_s3_stops_the_worker_with_one_line(r, cli_env, job_id) -> None:
    """The checkpoint store is opened when a training worker starts (before it joins): an S3
    endpoint that refuses connections ends the worker with exit 3 and one ``shoal:`` line."""
    create_job(r, JobSpec(name=job_id, entrypoint="tests.entrypoints:slow_digits", checkpoint_uri="s3://bucket/x"))
    cli_env = {**cli_env, "S3_ENDPOINT": f"http://127.0.0.1:{free_port()}", "S3_ACCESS_KEY": "shoal-key",
               "S3_SECRET_KEY": "s3-very-secret"}
    res = shoal(cli_env, "worker", job_id, "--join-timeout", "5")
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    # the worker's log lines go to stderr too (urllib3 logs its retries); the error is the one last line
    errors = [line for line in res.stderr.splitlines() if line.startswith("shoal: ")]
    assert errors == [res.stderr.splitlines()[-1]], res.stderr
    assert errors[0].startswith("shoal: create bucket bucket: S3 endpoint unreachable"), errors
    assert "s3-very-secret" not in res.stderr + res.stdout
    assert r.hlen(job_keys(job_id).workers) == 0  # it never joined


@pytest.mark.parametrize("command", ["submit", "create"])
@pytest.mark.parametrize("body, needles", [
    ("entrypoint: shoal.examples.digits:buidl\n", ["module 'shoal.examples.digits' has no attribute 'buidl'"]),
    ("entrypoint: no_such_module_here:build\n", ["cannot import 'no_such_module_here'"]),
    ("entrypoint: tests.entrypoints_broken:build\n", ["importing 'tests.entrypoints_broken' raised RuntimeError"]),
    ("entrypoint: shoal.examples.digits:build\ncheckpoint_uri: s3://bucket/x\n",
     ["checkpoint_uri s3://bucket/x: S3 settings missing: S3_ENDPOINT"]),
])
def test_a_job_that_cannot_run_is_refused_before_anything_is_written(r, cli_env, tmp_path, job_id, command, body,
                                                                     needles) -> None:
    """The entrypoint is imported (nothing is called) and an s3:// store's settings are looked
    for where the job is submitted: a job that could only crash every worker is refused with
    one line, instead of a job ``pending`` forever. ``--no-validate`` skips that check (code
    or settings that exist only on the worker nodes)."""
    clean = {k: v for k, v in cli_env.items() if not k.startswith("S3_")}
    spec = write(tmp_path / "job.yaml", f"name: {job_id}\n{body}")
    one_line_error(shoal(clean, command, spec), 2, *needles, "--no-validate")
    assert not r.exists(job_keys(job_id).spec)
    if command == "create":
        res = shoal(clean, command, spec, "--no-validate")
        assert res.returncode == 0, res.stderr
        assert r.exists(job_keys(job_id).spec)


def test_dry_build_calls_the_entrypoint_and_checks_what_it_returns(r, cli_env, tmp_path, job_id) -> None:
    spec = write(tmp_path / "job.yaml", f"name: {job_id}\nentrypoint: tests.entrypoints:empty_dataset\n")
    one_line_error(shoal(cli_env, "submit", spec, "--dry-build"), 2, "entrypoint 'tests.entrypoints:empty_dataset'",
                   "dataset is empty")
    one_line_error(shoal(cli_env, "create", spec, "--dry-build", "--no-validate"), 2, "contradict")
    one_line_error(shoal(cli_env, "create", spec, "--set", f"working_dir={tmp_path / 'nope'}"), 2,
                   f"working_dir {tmp_path / 'nope'}: no such directory")
    assert not r.exists(job_keys(job_id).spec)
    res = shoal(cli_env, "create", spec)  # importing it is fine: only the build shows the problem
    assert res.returncode == 0, res.stderr


def test_set_overrides_a_spec_file_field_and_is_validated_like_it(r, cli_env, tmp_path, job_id) -> None:
    from shoal.core.jobspec import JobSpec as _Spec

    spec = write(tmp_path / "job.yaml", f"name: {job_id}\nentrypoint: simulate\nepochs: 2\n")
    one_line_error(shoal(cli_env, "create", spec, "--set", "epochs=zero"), 2, "epochs: Input should be a valid integer")
    one_line_error(shoal(cli_env, "create", spec, "--set", "colour=red"), 2, "colour: Extra inputs are not permitted")
    res = shoal(cli_env, "create", spec, "--set", "epochs=9", "--set", "max_workers=5")
    assert res.returncode == 0, res.stderr
    stored = _Spec.from_stored(r.get(job_keys(job_id).spec))
    assert (stored.epochs, stored.max_workers) == (9, 5)


def test_unknown_job_is_the_same_one_line_everywhere_and_version_answers(cli_env, job_id) -> None:
    for command in ("status", "logs", "events", "report", "stop", "delete"):
        one_line_error(shoal(cli_env, command, job_id), 2, f"no job {job_id!r}")
    res = shoal(cli_env, "--version")
    assert res.returncode == 0 and res.stdout.startswith("shoal "), (res.stdout, res.stderr)


def test_events_follow_ends_once_the_job_ended(r, cli_env, job_id) -> None:
    keys = job_keys(job_id)
    create_job(r, JobSpec(name=job_id, entrypoint="simulate"))
    r.xadd(keys.control, {"ts_ms": "0", "generation": "1", "job_state": "completed", "kind": "completed",
                          "reason": "completed at step 5"})
    r.hset(keys.state, "state", "completed")
    res = shoal(cli_env, "events", job_id, "-f", timeout=30)
    assert res.returncode == 0, res.stderr
    assert "completed at step 5" in res.stdout
