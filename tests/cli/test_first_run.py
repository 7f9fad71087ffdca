"""Issue 37, first-run frictions as a new user meets them: ``shoal create job.yaml`` run (with
the ``shoal`` console script, which does not put the current folder on ``sys.path``) from
the folder holding the job's module imports it from there, as ``python -m shoal worker``
will on the nodes; the entrypoint's ``params`` are checked there too; ``shoal agent --help``
names where ``--run-dir`` really defaults to."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shoal.events.keys import job_keys
from shoal.ops.cli import build_parser
from shoal.ops.embedded import default_run_dir

#: A nanoGPT-style port: the entrypoint module imports a model module lying beside it.
MODEL = """
from torch import nn


def mlp(width):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
"""
PORT = """
import torch
from torch import nn

from model import mlp
from shoal import TrainingSetup
from shoal.examples.digits import DigitGlyphs


def build(width, lr=0.1):
    m = mlp(width)
    return TrainingSetup(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=lr), dataset=DigitGlyphs(size=256),
                         loss_fn=nn.CrossEntropyLoss(reduction="sum"))
"""


def _project(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "model.py").write_text(MODEL)
    (folder / "port_shoal.py").write_text(PORT)
    (folder / "job.yaml").write_text(f"name: {name}\nentrypoint: port_shoal:build\nparams: {{width: 16, lr: 3e-3}}\n")
    return folder


def _shoal(folder: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    """The ``shoal`` console script (not ``python -m shoal``) run in ``folder``."""
    script = Path(sys.executable).parent / "shoal"
    return subprocess.run([str(script), *args], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_create_from_the_folder_holding_the_module_imports_it_there_and_checks_params(r, cli_env, tmp_path,
                                                                                      job_id) -> None:
    folder = _project(tmp_path, job_id)
    env = {k: v for k, v in cli_env.items() if k != "PYTHONPATH"}
    done = _shoal(folder, env, "create", "job.yaml")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == job_id
    stored = json.loads(r.get(job_keys(job_id).spec))
    assert stored["params"] == {"width": 16, "lr": 3e-3}  # 3e-3 a float, as YAML 1.2 reads it

    # a wrong or missing argument is named, in one line, by the check made there
    bad = _shoal(folder, env, "create", "job.yaml", "--name", f"{job_id}-b", "--set", "params.widht=8")
    assert bad.returncode == 2 and bad.stdout == ""
    (line,) = bad.stderr.splitlines()
    assert "unexpected argument 'widht' in params: build(width, lr=0.1)" in line and "Traceback" not in line
    (folder / "job.yaml").write_text(f"name: {job_id}-c\nentrypoint: port_shoal:build\n")
    missing = _shoal(folder, env, "create", "job.yaml", "--dry-build")
    (line,) = missing.stderr.splitlines()
    assert missing.returncode == 2 and "missing argument 'width'" in line and "--set params.width=VALUE" in line
    assert r.get(job_keys(f"{job_id}-b").spec) is None and r.get(job_keys(f"{job_id}-c").spec) is None

    # from another folder the module is not there: the hint stays
    elsewhere = _shoal(tmp_path, env, "create", str(folder / "job.yaml"), "--name", f"{job_id}-d",
                       "--set", "params.width=8")
    assert elsewhere.returncode == 2
    assert "cannot import 'port_shoal'" in elsewhere.stderr and "--no-validate" in elsewhere.stderr


def test_agent_help_names_the_run_dir_default_it_uses(monkeypatch, tmp_path) -> None:
    agent = next(a for a in build_parser()._subparsers._group_actions[0].choices["agent"]._actions
                 if "--run-dir" in a.option_strings)
    assert "$SHOAL_HOME/agent/JOB" in agent.help and "~/.shoal/agent" not in agent.help
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path / "elsewhere"))
    assert default_run_dir().parent / "agent" == tmp_path / "elsewhere" / "agent"  # what cmd_agent defaults to
