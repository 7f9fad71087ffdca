"""The import-direction rule of the package, as data and a checker (used by test_layout.py).

Every module of the installed ``shoal`` package belongs to a layer; a module may import its
own layer's package and any layer below it, never one above it nor a sibling on its own level:

====  ===================================  ==========================================
rank  packages                             what they hold
====  ===================================  ==========================================
0     ``shoal.events``                     the cross-process contracts: key names, TTLs,
                                           models, environment variables, exit codes
1     ``shoal.core``                       errors, connection, job spec, registry, faults
2     ``shoal.storage``                    checkpoints, LATEST, datasets
3     ``shoal.coordinator``, ``shoal.worker``  the control plane and the training runtime
4     ``shoal.ops``                        operator tooling: CLI, demo, chaos, report, ...
5     ``shoal`` (its own modules)          the public API, ``python -m shoal``
6     ``shoal.examples``                   user code: imports the public API
====  ===================================  ==========================================

Pure decision modules (:data:`PURE`) may import only the wire contract, the core and their
own package (whose pure helpers they use), never a storage backend or anything doing I/O.
The folders come from ``pyproject.toml``'s ``package-dir`` table, so the rule follows the build.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

RANKS: dict[str, int] = {
    "shoal.events": 0,
    "shoal.core": 1,
    "shoal.storage": 2,
    "shoal.coordinator": 3,
    "shoal.worker": 3,
    "shoal.ops": 4,
    "shoal": 5,
    "shoal.examples": 6,
}

#: modules whose decisions must stay pure: they import only these layers
PURE: dict[str, tuple[str, ...]] = {
    "shoal.coordinator.decide": ("shoal.events", "shoal.core"),
    "shoal.coordinator.formation": ("shoal.events", "shoal.core"),
    "shoal.coordinator.redone": ("shoal.events", "shoal.core"),
    "shoal.worker.decide": ("shoal.events", "shoal.core"),
}


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported} ({self.why})"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """``{"shoal.worker": "worker", ...}`` from ``[tool.setuptools.package-dir]``."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    return dict(table["package-dir"])


def layer_of(module: str) -> str | None:
    """The layer (a key of RANKS) a dotted module name belongs to: the longest prefix."""
    best = None
    for pkg in RANKS:
        if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best)):
            best = pkg
    return best


def _modules(root: Path, dirs: dict[str, str]) -> list[tuple[str, Path]]:
    """(dotted module name, file) for every .py file the build installs."""
    out = []
    for pkg, folder in dirs.items():
        base = root / folder
        for path in sorted(base.glob("*.py")):
            name = pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"
            out.append((name, path))
    return out


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """Absolute names imported by a module (relative imports resolved); ``if TYPE_CHECKING``
    blocks count too: a type-only import that runs back up still couples the layers."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, package)
            found.append((node.lineno, target))
            # ``from shoal import ops`` names a subpackage: count it as that subpackage
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if layer_of(sub) == sub:
                    found[-1] = (node.lineno, sub)
    return found


def _from_target(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` names (a relative one resolved against
    ``package``, the importing module's package)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def check(root: Path, dirs: dict[str, str] | None = None) -> list[Violation]:
    """Every import in the tree at ``root`` that breaks the layering."""
    dirs = dirs if dirs is not None else package_dirs(root / "pyproject.toml")
    problems: list[Violation] = []
    for module, path in _modules(root, dirs):
        own = layer_of(module)
        if own is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(root))
        for line, imported in _imports(tree, module, path.stem == "__init__"):
            target = layer_of(imported)
            if target is None:
                continue  # not ours: stdlib or a dependency
            if module in PURE and target not in PURE[module] and target != own:
                problems.append(Violation(rel, line, module, imported, f"{module} is a pure decision module"))
            elif target == own:
                continue
            elif RANKS[target] > RANKS[own]:
                problems.append(Violation(rel, line, module, imported, f"{own} may not import upwards into {target}"))
            elif RANKS[target] == RANKS[own]:
                problems.append(Violation(rel, line, module, imported, f"{own} and {target} are siblings"))
    return problems


#: the modules that may tell one training layout from another (``shoal.worker.layout``):
#: the layouts themselves and the step engines they are built on
LAYOUT_MODULES = ("shoal.worker.layout", "shoal.worker.layouts", "shoal.worker.layout_dp",
                  "shoal.worker.layout_hsdp", "shoal.worker.layout_diloco", "shoal.worker.engine",
                  "shoal.worker.sharded_engine")
#: names whose use in a test outside those modules branches on the layout
LAYOUT_CLASSES = frozenset({"StepEngine", "ShardedEngine", "DataParallel", "Hsdp", "Diloco"})


def layout_branches(root: Path, dirs: dict[str, str] | None = None) -> list[Violation]:
    """Every place in the training runtime (``shoal.worker``) outside :data:`LAYOUT_MODULES`
    that branches on the layout: an ``isinstance`` naming a layout or engine class, a test
    (``if``, ``elif``, a conditional expression, ``and``/``or``) comparing a ``shard_size``
    with 1, or an ``hsdp`` attribute. The rest of the worker talks to ``Layout`` and never asks which one it
    holds (issue 36)."""
    dirs = dirs if dirs is not None else package_dirs(root / "pyproject.toml")
    problems: list[Violation] = []
    for module, path in _modules(root, dirs):
        if layer_of(module) != "shoal.worker" or module in LAYOUT_MODULES:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = str(path.relative_to(root))
        tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
        tests += [n for n in ast.walk(tree) if isinstance(n, ast.BoolOp)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                named = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
                        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if named & LAYOUT_CLASSES:
                    problems.append(Violation(rel, node.lineno, module, ", ".join(sorted(named & LAYOUT_CLASSES)),
                                              "isinstance on a layout outside the layouts"))
            if isinstance(node, ast.Attribute) and node.attr == "hsdp":
                problems.append(Violation(rel, node.lineno, module, "hsdp", "a layout flag outside the layouts"))
        for test in tests:
            for node in ast.walk(test):
                if isinstance(node, ast.Compare) and _against_one(node):
                    problems.append(Violation(rel, node.lineno, module, "shard_size",
                                              "a branch on the layout outside the layouts"))
    return problems


def _against_one(node: ast.Compare) -> bool:
    """``x.shard_size > 1``, ``== 1``, ``1 < x.shard_size``...: data parallelism or not. (A rule
    that holds for every layout, ``rank < table.shard_size`` - the first replica group's ranks -
    is no branch.)"""
    sides = [node.left, *node.comparators]
    sized = any(isinstance(n, ast.Attribute) and n.attr == "shard_size" for n in sides)
    one = any(isinstance(n, ast.Constant) and n.value == 1 for n in sides)
    return sized and one


def import_graph(root: Path, dirs: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports, anywhere in its body (an import inside a
    function too: it hides a circle, it does not break one). ``from package import module``
    counts as the module."""
    dirs = dirs if dirs is not None else package_dirs(root / "pyproject.toml")
    files = dict(_modules(root, dirs))
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        names: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _from_target(node, package)
                names += [f"{target}.{alias.name}" if f"{target}.{alias.name}" in files else target
                          for alias in node.names]
        deps = set()
        for name in names:
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module:
                deps.add(name)
        graph[module] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: each strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
