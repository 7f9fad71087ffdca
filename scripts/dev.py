#!/usr/bin/env python3
"""Bootstrap a project virtualenv (.venv) and run a command inside it.

Usage:  python3 scripts/dev.py shoal demo
        python3 scripts/dev.py pytest [ARGS...]

Needs only Python 3.11+. The first run creates .venv, installs the pinned CPU
build of torch first (so no multi-GB CUDA build is pulled), then the project
with its test extras. Later runs reinstall only when pyproject.toml changed.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
TORCH_PIN = "torch==2.13.0"


def _bin(name: str) -> Path:
    return VENV / ("Scripts" if os.name == "nt" else "bin") / name


def _ensure_venv() -> None:
    stamp = VENV / ".shoal-installed"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    if sys.version_info < (3, 11):
        sys.exit(f"shoal needs Python 3.11+, this is {sys.version.split()[0]}")
    if not _bin("python").exists():
        print("dev: creating .venv", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    pip = [str(_bin("python")), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    print(f"dev: installing {TORCH_PIN} (CPU) and the project", file=sys.stderr)
    subprocess.run(pip + [TORCH_PIN], check=True)
    subprocess.run(pip + ["-e", f"{ROOT}[test]"], check=True)
    stamp.write_text(digest)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    _ensure_venv()
    exe = _bin(argv[0])
    cmd = [str(exe)] + argv[1:] if exe.exists() else [str(_bin("python")), "-m"] + argv
    env = dict(os.environ, VIRTUAL_ENV=str(VENV), PATH=f"{_bin('python').parent}{os.pathsep}{os.environ.get('PATH', '')}")
    os.chdir(ROOT)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
