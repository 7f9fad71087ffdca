"""Shell completion (``shoal completion bash``), driven through a real bash: commands,
options and the job ids registered in Redis complete; an unreachable server completes
nothing, quickly and quietly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.core.jobspec import JobSpec
from shoal.core.registry import delete_job
from shoal.ops.cli import _complete_jobs
from shoal.ops.embedded import free_port
from shoal.ops.submit import register
from tests.helpers import run_cli


def complete(env: dict[str, str], script: str, line: str) -> list[str]:
    """What bash offers after typing ``line`` (split on spaces; a trailing space starts a new word)."""
    words = line.split(" ")
    prog = (
        f"source {script}\n"
        f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        "_python_argcomplete shoal\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    res = subprocess.run(["bash", "-c", prog], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [w.strip() for w in res.stdout.splitlines() if w.strip()]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_commands_options_and_job_ids(r, subprocess_env, tmp_path, job_id) -> None:
    # the script runs the `shoal` console script next to this interpreter
    env = {**subprocess_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{subprocess_env['PATH']}"}
    out = run_cli(env, "completion", "bash")
    assert out.returncode == 0, out.stderr
    script = tmp_path / "shoal.bash"
    script.write_text(out.stdout)
    register(r, JobSpec(name=job_id, entrypoint="simulate"))
    try:
        assert complete(env, script, "shoal sta") == ["status"]
        assert complete(env, script, "shoal submit job.yaml --no-") == ["--no-validate"]
        assert job_id in complete(env, script, f"shoal status {job_id[:6]}")  # other tests' jobs may match too
        assert complete(env, script, f"shoal logs {job_id}") == [job_id]
    finally:
        delete_job(r, job_id, lease_wait=0)
    assert complete(env, script, f"shoal logs {job_id}") == []


def test_job_ids_complete_to_nothing_when_no_server_answers(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    assert _complete_jobs("") == []
    monkeypatch.delenv("REDIS_URL")
    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))  # no embedded server was ever started there
    assert _complete_jobs("") == []


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_other_shells_get_a_script_naming_shoal(subprocess_env, shell) -> None:
    out = run_cli(subprocess_env, "completion", shell)
    assert out.returncode == 0 and "shoal" in out.stdout and len(out.stdout.splitlines()) > 5
    bad = run_cli(subprocess_env, "completion", "tcsh")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
