"""``tensorboard_dir`` at submit: a job that asks for TensorBoard files where the package is
missing, with a relative path, or on S3 without S3 settings is refused with one line naming
the cause, and nothing is written."""

from __future__ import annotations

import pytest

from shoal.events.keys import job_keys
from tests.cli.test_bad_input_cli import one_line_error
from tests.helpers import run_cli as shoal

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command, value, block, needles", [
    ("create", "{tmp}/tb", True, ["tensorboard_dir {tmp}/tb: the tensorboard package is not installed",
                                  "pip install 'shoal[tensorboard]'"]),
    ("submit", "runs/tb", False, ["tensorboard_dir: Value error, must be an absolute path"]),
    ("create", "s3://bucket/tb", False, ["tensorboard_dir s3://bucket/tb: ", "S3_ENDPOINT"]),
])
def test_tensorboard_dir_refused_at_submit(r, cli_env, tmp_path, job_id, command, value, block, needles) -> None:
    value = value.format(tmp=tmp_path)
    cli_env = {k: v for k, v in cli_env.items() if not k.startswith("S3_")}
    if block:  # the interpreter of the command has no tensorboard package
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None\n")
        cli_env["PYTHONPATH"] = str(site)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: {job_id}\nentrypoint: shoal.examples.digits:build\ntensorboard_dir: {value}\n")
    one_line_error(shoal(cli_env, command, str(spec)), 2, *[n.format(tmp=tmp_path) for n in needles])
    assert not r.exists(job_keys(job_id).spec)
