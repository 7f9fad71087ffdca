"""Packaging and layering: one ``shoal`` import name, layers that only point down."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.packaging.layers import check, layer_of, layout_branches, package_dirs

DIRS = package_dirs(ROOT / "pyproject.toml")


def test_the_tree_imports_only_downwards() -> None:
    problems = check(ROOT)
    assert not problems, "imports that run back up:\n" + "\n".join(map(str, problems))


def test_nothing_outside_the_layouts_branches_on_the_layout() -> None:
    problems = layout_branches(ROOT)
    assert not problems, "branches on data parallel vs HSDP outside the layouts:\n" + "\n".join(map(str, problems))


@pytest.mark.parametrize("source", [
    "def f(engine):\n    return isinstance(engine, ShardedEngine)\n",
    "def f(spec):\n    if spec.shard_size > 1:\n        return 1\n",
    "def f(spec):\n    return 2 if spec.shard_size == 1 else 3\n",
    "def f(self):\n    return self.switch.hsdp\n",
])
def test_a_branch_on_the_layout_outside_the_layouts_fails_the_check(tmp_path: Path, source: str) -> None:
    root = _synthetic_tree(tmp_path, {"worker/__init__.py": "", "worker/training.py": source,
                                      "worker/layout_hsdp.py": "x = isinstance(1, Hsdp)\n"})
    problems = layout_branches(root, {"shoal.worker": "worker"})
    assert [p.path for p in problems] == ["worker/training.py"], problems


def _synthetic_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


SYNTH_DIRS = {"shoal": "api", "shoal.events": "events", "shoal.core": "core", "shoal.worker": "worker",
              "shoal.coordinator": "coordinator", "shoal.ops": "ops"}


@pytest.mark.parametrize(("source", "why"), [
    ("from shoal.ops.cli import main\n", "may not import upwards into shoal.ops"),
    ("import shoal.ops.demo\n", "may not import upwards into shoal.ops"),
    ("from shoal.ops import cli\n", "may not import upwards into shoal.ops"),
    ("from shoal import TrainingSetup\n", "may not import upwards into shoal"),
    ("from ..ops import cli\n", "may not import upwards into shoal.ops"),
    ("from shoal.coordinator.decide import decide\n", "are siblings"),
    ("def f():\n    from shoal.ops.submit import submit\n", "may not import upwards into shoal.ops"),
])
def test_a_worker_file_importing_upwards_fails_the_check(tmp_path: Path, source: str, why: str) -> None:
    root = _synthetic_tree(tmp_path, {"worker/__init__.py": "", "worker/agent.py": source, "ops/__init__.py": "",
                                      "ops/cli.py": "", "events/__init__.py": ""})
    problems = check(root, SYNTH_DIRS)
    assert [p.path for p in problems] == ["worker/agent.py"], problems
    assert why in problems[0].why


def test_downward_and_own_layer_imports_pass_the_check(tmp_path: Path) -> None:
    root = _synthetic_tree(tmp_path, {
        "worker/__init__.py": "",
        "worker/agent.py": "import json\nfrom shoal.events.keys import job_keys\nfrom shoal.core.errors import X\n"
                           "from shoal.worker import ledger\nfrom . import ledger\nimport torch\n",
        "ops/cli.py": "from shoal.worker.agent import NodeAgent\nfrom shoal.coordinator.loop import Coordinator\n",
        "api/__init__.py": "from shoal.worker.userapi import TrainingSetup\n",
    })
    assert check(root, SYNTH_DIRS) == []


def test_the_pure_decision_function_imports_only_the_wire_contract_and_core(tmp_path: Path) -> None:
    root = _synthetic_tree(tmp_path, {"coordinator/decide.py": "from shoal.storage.latest import LatestPointer\n"})
    problems = check(root, {**SYNTH_DIRS, "shoal.storage": "storage"})
    assert len(problems) == 1 and "pure decision module" in problems[0].why


def test_every_package_folder_is_installed_and_every_installed_package_exists() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(table["packages"]) == sorted(DIRS), "packages and package-dir must name the same packages"
    mapped = {(ROOT / folder).resolve() for folder in DIRS.values()}
    for folder in DIRS.values():
        assert (ROOT / folder / "__init__.py").is_file(), f"{folder}/ is mapped but is not a package"
        # a subfolder holding Python code that the build does not install would be lost from the wheel
        for sub in (ROOT / folder).iterdir():
            if sub.is_dir() and any(sub.glob("*.py")):
                assert sub.resolve() in mapped, f"{sub.relative_to(ROOT)} holds code the wheel would not install"
    assert not (ROOT / "shoal").exists(), "a folder named shoal/ would shadow an installed shoal from the checkout"
    assert layer_of("shoal.ops.chaos.run") == "shoal.ops"
    assert layer_of("shoal.ops.api.app") == "shoal.ops"  # the HTTP API is operator tooling, like the CLI


def test_no_code_or_test_edits_sys_path() -> None:
    offenders = []
    for folder in [*DIRS.values(), "tests", "bench", "scripts"]:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                        and node.value.id == "sys"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _private_shoal_imports(source: str) -> list[str]:
    """The imports of an example (a module of ``shoal.examples``) that reach past the public
    API: anything of ``shoal`` other than ``import shoal``, ``from shoal import ...`` and
    another example (``shoal.examples.*``, e.g. torchrun_ddp.py reusing digits.py's model).
    Imports inside functions count too."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = ["shoal", "examples"][:max(0, 3 - node.level)] if node.level else []
            modules = [".".join([*package, *([node.module] if node.module else [])])]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "shoal" and module != "shoal" and parts[1] != "examples":
                found.append(f"{node.lineno}: {module}")
    return found


@pytest.mark.parametrize(("source", "bad"), [
    ("from shoal import TrainingSetup\nimport shoal\n", []),
    ("from shoal.examples.digits import make_model\nfrom .digits import evaluate\n", []),
    ("def f():\n    from shoal.worker.engine import StepEngine\n", ["2: shoal.worker.engine"]),
    ("import shoal.worker.data as data\n", ["1: shoal.worker.data"]),
    ("from ..worker import engine\n", ["1: shoal.worker"]),
])
def test_the_example_import_check_tells_public_from_private(source: str, bad: list[str]) -> None:
    assert _private_shoal_imports(source) == bad


def test_examples_import_only_the_public_api() -> None:
    """The examples are what users copy: they show ``from shoal import ...`` only (what they
    need is exported by the package root, api/__init__.py)."""
    private = {str(path.relative_to(ROOT)): found for path in sorted((ROOT / "examples").glob("*.py"))
               if (found := _private_shoal_imports(path.read_text()))}
    assert private == {}, "examples importing shoal's internals (export what they need from api/__init__.py)"
