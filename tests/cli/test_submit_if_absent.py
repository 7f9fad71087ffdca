"""``shoal submit --if-absent`` (compose's one-shot ``submit`` service, which runs on every
``up``): a job of that name exists -> nothing is written or queued, exit 0, one line saying so;
without the flag the same submit is refused (exit 2). Found by scripts/compose_check.py,
scenario down-up: after ``docker compose down`` and ``up`` the service exited 2."""

from __future__ import annotations

import pytest

from shoal.coordinator.launcher import launch_queue
from shoal.events.keys import job_keys
from tests.cli.test_bad_input_cli import one_line_error
from tests.helpers import run_cli as shoal

pytestmark = pytest.mark.slow


def test_submit_if_absent_leaves_an_existing_job_alone(r, cli_env, tmp_path, job_id) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: {job_id}\nentrypoint: shoal.examples.digits:build\nmax_workers: 2\n")
    first = shoal(cli_env, "submit", str(spec), "--if-absent")
    assert first.returncode == 0, first.stderr
    queued = launch_queue(r).count
    written = r.dump(job_keys(job_id).spec)
    again = shoal(cli_env, "submit", str(spec), "--if-absent")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == job_id
    assert again.stderr.strip().splitlines()[-1] == \
        f"shoal: job {job_id} already exists; not submitted again (--if-absent)"
    assert launch_queue(r).count == queued and r.dump(job_keys(job_id).spec) == written
    one_line_error(shoal(cli_env, "submit", str(spec)), 2, f"job '{job_id}' already exists")
    assert launch_queue(r).count == queued
