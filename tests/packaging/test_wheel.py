"""The built wheel: exactly one top-level package, and it works installed (not editable).

The wheel is built from a copy of the folders the build maps (so the checkout gets no
``build/`` or ``.egg-info``), installed with ``--no-deps`` into a fresh virtualenv whose
dependencies come from this test environment (a ``.pth`` line: no network in the suite), and
run from outside the checkout and from inside it. CI's ``scripts/wheel_check.py`` goes further:
a venv that installs the wheel's dependencies from the index, then ``shoal demo``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.packaging.layers import package_dirs

pytestmark = pytest.mark.slow


def _run_checked(cmd: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``cmd``, which must exit 0 (else the test fails with the tail of its output)."""
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in set(package_dirs(ROOT / "pyproject.toml").values()):
        if "/" not in folder:
            shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    _run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
                 cwd=src)
    (whl,) = dist.glob("shoal-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (not editable); returns its python."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run_checked([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], cwd=env_dir)
    site = Path(_run_checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=env_dir)
                .stdout.strip())
    # the dependencies (torch, redis, ...) from this environment, after the venv's own packages
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_installs_exactly_one_top_level_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"shoal"}, sorted(top)
    assert len(dist_info) == 1
    for expected in ("shoal/__init__.py", "shoal/__main__.py", "shoal/worker/userapi.py", "shoal/ops/cli.py",
                     "shoal/ops/chaos/run.py", "shoal/examples/digits.py", "shoal/examples/job.yaml",
                     "shoal/events/keys.py", "shoal/core/jobspec.py", "shoal/storage/checkpoint.py",
                     "shoal/coordinator/decide.py", "shoal/ops/api/app.py", "shoal/ops/api/static/index.html",
                     "shoal/ops/api/static/app.js", "shoal/ops/api/static/chart.js", "shoal/ops/api/static/rates.js",
                     "shoal/ops/api/static/style.css"):
        assert expected in names, f"{expected} missing from the wheel"
    assert not [n for n in names if n.startswith("shoal/") and "/tests/" in n]


def test_the_installed_wheel_serves_the_public_api_and_the_default_entrypoint(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import shoal, pathlib\n"
        "from shoal import TrainingSetup, JobSpec, load_entrypoint\n"
        "assert shoal.TrainingSetup is TrainingSetup\n"
        "print(pathlib.Path(shoal.__file__).resolve())\n"
        "setup = load_entrypoint(JobSpec(name='wheel').entrypoint, 0)\n"
        "assert isinstance(setup, TrainingSetup) and len(setup.dataset) > 0\n"
        "print('version', shoal.__version__)\n"
    )
    out = _run_checked([str(installed), "-c", probe], cwd=tmp_path)
    where, version = out.stdout.split("\n")[:2]
    assert Path(where).is_relative_to(installed.parent.parent), f"imported {where}, not the installed wheel"
    assert version == "version 0.1.0"


@pytest.mark.parametrize("where", ["elsewhere", "checkout"])
def test_the_installed_cli_runs_from_anywhere(installed: Path, tmp_path: Path, where: str) -> None:
    # from the checkout too: no folder there named shoal may shadow the installed package
    cwd = ROOT if where == "checkout" else tmp_path
    out = _run_checked([str(installed), "-m", "shoal", "--help"], cwd=cwd)
    assert "coordinator" in out.stdout and "agent" in out.stdout
    out = _run_checked([str(installed.parent / "shoal"), "cluster", "--help"], cwd=cwd)
    assert "validate" in out.stdout
