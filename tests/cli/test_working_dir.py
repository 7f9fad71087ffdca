"""A job's code reaches the workers through its ``working_dir`` (issue 14, acceptance 4).

The packing rules (deterministic, excludes, bounds, unsafe archives refused, checksum) are
checked directly; then a real job: submitted from a project directory holding a module that
exists nowhere else, served by a node agent running in another directory, trains to the end;
a job whose stored package is corrupt fails with that cause instead of crash-looping.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile

import pytest

from shoal.core.errors import ConfigError
from shoal.events.keys import job_keys
from shoal.storage import code_package
from shoal.storage.code_package import CodePackage, CodePackageError, pack_dir, unpack
from shoal.ops.submit import register
from tests.helpers import ControlWatcher, dump_logs, run_cli

TRAIN_MODULE = '''
import json
import pathlib

from shoal.examples.digits import build as digits


def build():
    # a relative path: the job's working directory is its unpacked working_dir
    settings = json.loads(pathlib.Path("conf/settings.json").read_text())
    assert settings == {"hidden": 32}, settings
    return digits()
'''


def make_project(root, module: str) -> None:
    (root / "conf").mkdir(parents=True)
    (root / f"{module}.py").write_text(TRAIN_MODULE)
    (root / "conf" / "settings.json").write_text(json.dumps({"hidden": 32}))
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "junk.pyc").write_bytes(b"\0" * 100)
    (root / "data").mkdir()
    (root / "data" / "big.bin").write_bytes(b"x" * 1000)


def names(package: CodePackage) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(package.data), mode="r:gz") as tar:
        return tar.getnames()


def test_packing_is_deterministic_and_leaves_out_caches_and_excluded_paths(tmp_path) -> None:
    make_project(tmp_path / "p", "mod")
    one = pack_dir(tmp_path / "p", ["data/*"])
    (tmp_path / "p" / "mod.py").touch()  # a new mtime: not part of the package
    two = pack_dir(tmp_path / "p", ["data/*"])
    assert one.sha256 == two.sha256 and one.data == two.data
    assert sorted(names(one)) == ["conf/settings.json", "mod.py"]
    assert sorted(names(pack_dir(tmp_path / "p"))) == ["conf/settings.json", "data/big.bin", "mod.py"]
    (tmp_path / "p" / "mod.py").write_text("changed = 1\n")
    assert pack_dir(tmp_path / "p", ["data"]).sha256 != one.sha256


def test_packing_refuses_what_is_too_big_naming_the_largest_file(tmp_path, monkeypatch) -> None:
    make_project(tmp_path / "p", "mod")
    monkeypatch.setattr(code_package, "MAX_UNPACKED_BYTES", 500)
    with pytest.raises(ConfigError) as err:
        pack_dir(tmp_path / "p")
    msg = str(err.value)
    assert "\n" not in msg and "data/big.bin" in msg and "working_dir_excludes" in msg
    assert pack_dir(tmp_path / "p", ["data"]).files == 2  # excluded, it fits
    with pytest.raises(ConfigError, match="no such directory"):
        pack_dir(tmp_path / "nope")


def forged(member: tarfile.TarInfo, payload: bytes = b"") -> CodePackage:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        member.size = len(payload) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(payload) if member.isfile() else None)
    import hashlib

    return CodePackage(buf.getvalue(), hashlib.sha256(buf.getvalue()).hexdigest(), len(payload), 1)


@pytest.mark.parametrize("member", [
    tarfile.TarInfo("../escape.py"),
    tarfile.TarInfo("/etc/evil.py"),
    pytest.param(tarfile.TarInfo("link"), id="symlink"),
])
def test_unpacking_refuses_unsafe_members_and_leaves_nothing(tmp_path, member) -> None:
    if member.name == "link":
        member.type, member.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(CodePackageError):
        unpack(forged(member, b"print('owned')"), tmp_path / "run")
    assert not (tmp_path / "escape.py").exists()
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # no partial directory left


def test_a_package_unpacks_once_with_its_modes_and_a_corrupt_one_is_refused(r, tmp_path, job_id) -> None:
    make_project(tmp_path / "p", "mod")
    (tmp_path / "p" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "p" / "run.sh").chmod(0o755)
    package = pack_dir(tmp_path / "p")
    key = job_keys(job_id).code
    package.write(r, key)
    try:
        read = CodePackage.read(r, key)
        assert read == package
        dest = unpack(read, tmp_path / "run")
        assert (dest / "conf" / "settings.json").read_text() == '{"hidden": 32}'
        assert (dest / "run.sh").stat().st_mode & 0o111 and not (dest / "mod.py").stat().st_mode & 0o111
        assert unpack(read, tmp_path / "run") == dest  # reused, not unpacked again
        r.hset(key, "tar", package.data[:-10])
        with pytest.raises(CodePackageError, match="corrupt"):
            CodePackage.read(r, key)
    finally:
        r.delete(key)
    assert CodePackage.read(r, key) is None


@pytest.mark.slow
def test_a_job_submitted_from_a_directory_the_agents_do_not_share_trains(r, cli_env, tmp_path, job_id, procs,
                                                                       queue) -> None:
    module = "wd_" + job_id.replace("-", "_")
    project = tmp_path / "project"
    make_project(project, module)
    (project / "job.yaml").write_text(
        f"name: {job_id}\nentrypoint: {module}:build\nmax_steps: 6\nmin_workers: 2\nmax_workers: 2\n"
        "working_dir: .\nworking_dir_excludes: [data]\n")
    other = tmp_path / "elsewhere"  # the node agent's directory: no trace of the module
    other.mkdir()
    with pytest.raises(ModuleNotFoundError):
        __import__(module)
    # the check at submit imports the module from working_dir, as a worker will
    bad = subprocess.run([sys.executable, "-m", "shoal", "submit", str(project / "job.yaml"), "--set",
                          f"entrypoint={module}:buidl"], env=cli_env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert f"has no attribute 'buidl' (imported from working_dir {project.resolve()})" in bad.stderr
    sub = subprocess.run([sys.executable, "-m", "shoal", "submit", "job.yaml", "--workers", "2"], cwd=project,
                         env=cli_env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    spec = json.loads(r.get(job_keys(job_id).spec))
    assert spec["working_dir"] == str(project.resolve())
    assert r.hget(job_keys(job_id).code, "files") == b"3"  # the module, conf/settings.json, job.yaml

    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    agent = subprocess.Popen([sys.executable, "-m", "shoal", "agent", "--queue", "--burst", "--run-dir",
                              str(tmp_path / "agent")], cwd=other, env=cli_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        done = watch.wait_for(lambda d: d.job_state in ("completed", "failed"), 120)
        assert done.job_state == "completed", done.reason
        assert agent.wait(60) == 0
    except BaseException:
        agent.kill()
        print(agent.communicate()[1][-4000:])
        dump_logs(procs, tmp_path / "agent")
        raise
    unpacked = list((tmp_path / "agent").glob(f"{job_id}/*/code-*"))
    assert len(unpacked) == 1 and (unpacked[0] / f"{module}.py").exists()
    assert not (unpacked[0] / "data").exists()


@pytest.mark.slow
def test_a_job_whose_code_package_is_corrupt_fails_with_that_cause(r, cli_env, tmp_path, job_id, procs) -> None:
    project = tmp_path / "project"
    make_project(project, "mod")
    res = run_cli(cli_env, "create", "--name", job_id, "--set", f"working_dir={project}", "--set", "max_steps=3",
                  "--set", "entrypoint=mod:build")
    assert res.returncode == 0, res.stderr
    r.hset(job_keys(job_id).code, "tar", b"not the package")
    watch = ControlWatcher(r, job_id)
    procs.coordinator("coord")
    agent = procs.start("agent", "agent", job_id, "--workers", "2", "--node", "n3", "--run-dir",
                        str(tmp_path / "agent"))
    failed = watch.wait_for(lambda d: d.job_state == "failed", 60)
    assert agent.wait(30) == 1
    assert "the worker process on node n3 (slot 0) could not be started" in failed.reason, failed.reason
    assert "code package" in failed.reason and "corrupt" in failed.reason
    logs = run_cli(cli_env, "logs", job_id)
    assert "no worker can start on node n3" in logs.stdout and "corrupt" in logs.stdout


def test_an_agent_registers_a_lost_job_again_with_its_code(tmp_path, monkeypatch) -> None:
    """Redis lost its data (a new server): the agent registers the job again from the spec it
    holds, and its code package with it, so agents started later still get the code."""
    import fakeredis

    from shoal.core.jobspec import JobSpec
    from shoal.worker import agent as agent_mod

    make_project(tmp_path / "p", "mod")
    client = fakeredis.FakeRedis()
    spec = JobSpec(name="lost", entrypoint="mod:build", working_dir=str(tmp_path / "p"))
    register(client, spec)
    monkeypatch.setattr(agent_mod, "server_run_id", lambda _client: "server-1")
    node = agent_mod.NodeAgent(client, "redis://unused", "lost", 1, run_dir=tmp_path / "run", spec=spec)
    node._prepare_code()
    assert node.code_dir is not None and (node.code_dir / "mod.py").exists()
    package = CodePackage.read(client, job_keys("lost").code)
    client.flushall()
    monkeypatch.setattr(agent_mod, "server_run_id", lambda _client: "server-2")
    node._check_job(now=1e9)
    assert node.reregistered == 1
    assert CodePackage.read(client, job_keys("lost").code) == package
