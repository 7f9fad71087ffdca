#!/usr/bin/env python3
"""Build the wheel, install it into a fresh virtualenv the way a user would, and run it.

Usage:  python3 scripts/wheel_check.py [--no-demo]

The venv gets the pinned CPU torch first (an unpinned one pulls a multi-GB CUDA build), then
``pip install dist/shoal-*.whl`` resolves the other dependencies from the package index. From
a directory outside the checkout it then checks ``from shoal import TrainingSetup`` and runs
``shoal demo`` (embedded Redis, a coordinator, 3 workers; about 90 s on 2 cores). CI runs it
after the test suite; the suite's tests/packaging/test_wheel.py checks the same wheel offline.
Exit status: 0 when every step passed, else the failing step's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from dev import ROOT, TORCH_PIN


def step(what: str, cmd: list[str], cwd: Path) -> None:
    print(f"wheel-check: {what}", flush=True)
    rc = subprocess.call(cmd, cwd=cwd)
    if rc != 0:
        print(f"wheel-check: FAILED ({what}): exit {rc}", file=sys.stderr)
        sys.exit(rc)


def main(argv: list[str]) -> int:
    demo = "--no-demo" not in argv
    with tempfile.TemporaryDirectory(prefix="shoal-wheel-") as tmp:
        work = Path(tmp)
        dist = work / "dist"
        step("build the wheel", [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
             cwd=work)
        shutil.rmtree(ROOT / "build", ignore_errors=True)  # setuptools' in-tree build folder
        (wheel,) = dist.glob("shoal-*.whl")
        env_dir = work / "venv"
        venv.EnvBuilder(with_pip=True).create(env_dir)
        python = env_dir / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        step(f"install {TORCH_PIN} (CPU)", pip + [TORCH_PIN], cwd=work)
        step(f"pip install {wheel.name} (not editable; dependencies from the index)", pip + [str(wheel)], cwd=work)
        probe = ("import pathlib, shoal; from shoal import TrainingSetup; "
                 f"assert pathlib.Path(shoal.__file__).is_relative_to({str(env_dir)!r}), shoal.__file__; "
                 "print('wheel-check: shoal', shoal.__version__, 'from', shoal.__file__)")
        step("import shoal; shoal.TrainingSetup", [str(python), "-c", probe], cwd=work)
        if demo:
            step("shoal demo", [str(env_dir / "bin" / "shoal"), "demo"], cwd=work)
    print("wheel-check: passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
