"""Every attribute of a worker-side class is created in ``__init__`` (its own or a base's in
worker/, or declared as a dataclass field): a method may change an attribute, never grow a
new one. Read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "worker"


def _stored(fn: ast.AST) -> set[str]:
    """Names of ``self.X`` assigned anywhere in ``fn``."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            out.add(node.attr)
    return out


def _classes() -> dict[str, ast.ClassDef]:
    classes = {}
    for path in sorted(WORKER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node
    return classes


def test_no_worker_class_creates_attributes_outside_init() -> None:
    classes = _classes()
    assert {"TrainingWorker", "WorkerRunner", "StepEngine", "Heartbeater"} <= set(classes)

    def created(cls: ast.ClassDef) -> set[str]:
        names = set()
        dataclass = any((d.id if isinstance(d, ast.Name) else getattr(getattr(d, "func", None), "id", "")) == "dataclass"
                        for d in cls.decorator_list)
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                names |= _stored(item)
            elif dataclass and isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                names.add(item.target.id)  # a dataclass field: its generated __init__ sets it
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                names |= created(classes[base.id])
        return names

    grown = {}
    for name, cls in classes.items():
        init = created(cls)
        for item in cls.body:
            if isinstance(item, ast.FunctionDef) and item.name != "__init__":
                extra = _stored(item) - init
                if extra:
                    grown[f"{name}.{item.name}"] = sorted(extra)
    assert not grown, f"attributes created outside __init__: {grown}"
