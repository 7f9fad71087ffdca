"""The README's "Using it" section, run literally (issue 14): every command of its code block,
in order, in a throwaway directory holding an untouched copy of ``examples/``, with no
``REDIS_URL`` (the embedded server) and a throwaway ``SHOAL_HOME``. Lines ending in ``&`` run in
the background; ``shoal events digits -f`` ends once the job ended. Every foreground command
must exit 0 and the job must complete: before issue 14 the shipped example needed S3
settings, every worker died before joining, and the job stayed ``pending`` forever."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
CHECKPOINTS = Path("/tmp/shoal-checkpoints/digits")  # examples/job.yaml's checkpoint_uri


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        code = line.split("#", 1)[0].strip()
        if code and not code.startswith("export REDIS_URL"):  # "omit to use the embedded server"
            commands.append(code)
    return commands


def test_the_readme_using_it_commands_work_as_written(tmp_path) -> None:
    commands = readme_commands()
    assert commands[0] == "shoal create examples/job.yaml" and any(c.endswith("&") for c in commands)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    shutil.rmtree(CHECKPOINTS, ignore_errors=True)  # a previous run's checkpoints would end the job at once
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REDIS_URL", "SHOAL_", "S3_"))}
    env.update(SHOAL_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    background: list[subprocess.Popen] = []
    try:
        for command in commands:
            argv = shlex.split(command.rstrip("&").strip())
            assert argv[0] == "shoal", command
            if command.endswith("&"):
                log = open(tmp_path / f"bg{len(background)}.log", "w")
                background.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
                continue
            res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, (command, res.stdout[-2000:], res.stderr[-2000:])
        status = subprocess.run(["shoal", "status", "digits", "--json"], cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=60)
        s = json.loads(status.stdout)
        assert s["state"] == "completed", s
        assert s["progress"]["total_steps"] == s["progress"]["step"] == 237  # 3 epochs of 79 steps
        assert s["progress"]["percent"] == 100.0
        assert (tmp_path / "report.png").stat().st_size > 10_000
    except BaseException:
        for f in sorted(tmp_path.glob("bg*.log")):
            print(f"===== {f.name}\n{f.read_text()[-3000:]}")
        raise
    finally:
        for p in background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in background:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(CHECKPOINTS, ignore_errors=True)
