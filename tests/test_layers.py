"""Imports only point down: ops (and env.py) <- patching <- integrations <- CLI; inside ops, the
shared machinery (``ops/core/``) <- each loss (``ops/cross_entropy/``, ``ops/distillation/``, which
never import each other) <- ``ops``' own modules (its ``__init__``, the fp64 reference, the
aliases of old paths); and no import cycle anywhere.

Every module of ``liger_patch/`` is parsed with ``ast`` and every import in it (at any depth:
inside functions, under ``if TYPE_CHECKING``, relative ``from . import x`` forms too) is resolved
to the module it names; an import of a module in a higher layer than the importer fails, naming
both. ``liger_patch/__init__.py`` re-exports the public API from every layer and is exempt as an
importer; imported (``import liger_patch``, ``from liger_patch import apply_liger_to``) it counts
as the integrations layer, the highest it re-exports from.

The CLI layer is ``liger_patch/verify/`` (the verification sweep and its tiny-model factory) and
the top-level command modules (``__main__``, ``doctor``, ``demo``, ``peak_memory``).

Each check is shown able to fail: a copy of the package with one violating import planted in it
(or a graph built by hand) is checked, and the violation is named.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "liger_patch"

OPS, PATCHING, INTEGRATIONS, CLI = 0, 1, 2, 3
LAYER_NAMES = {OPS: "ops", PATCHING: "patching", INTEGRATIONS: "integrations", CLI: "CLI"}

ROOT = "liger_patch"
# Modules of the CLI layer living outside a CLI package, by exact name or as a package prefix.
CLI_MODULES = ("liger_patch.__main__", "liger_patch.doctor", "liger_patch.demo", "liger_patch.peak_memory")
CLI_PACKAGES = ("liger_patch.verify",)
LAYER_PACKAGES = {
    "liger_patch.env": OPS,  # environment flags: anyone may import it
    "liger_patch.ops": OPS,
    "liger_patch.patching": PATCHING,
    "liger_patch.integrations": INTEGRATIONS,
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer_of(name: str) -> int:
    """The layer of module ``name`` (``liger_patch`` itself: integrations, see the module doc)."""
    if name == ROOT:
        return INTEGRATIONS
    if name in CLI_MODULES or any(_within(name, p) for p in CLI_PACKAGES):
        return CLI
    for package, layer in LAYER_PACKAGES.items():
        if _within(name, package):
            return layer
    raise AssertionError(f"{name} is in no layer: classify it in tests/test_layers.py")


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, package_dir: Path) -> bool:
    """Whether ``name`` (dotted, under the package) is a module or package on disk."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = package_dir / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported_modules(source: str, name: str, is_package: bool, package_dir: Path = PACKAGE_DIR):
    """``(line, module)`` for every import of a ``liger_patch`` module in ``source`` (the module
    ``name``). ``from a import b`` names ``a.b`` when that is a module, else ``a``."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, ROOT):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if not _within(base, ROOT):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if _is_module(sub, package_dir) else base


def upward_imports(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Every import in the package that points up a layer, as ``path:line: a (layer) imports b (layer)``."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name(path, package_dir)
        if name == ROOT:
            continue
        mine = layer_of(name)
        source = path.read_text(encoding="utf-8")
        for line, target in imported_modules(source, name, path.name == "__init__.py", package_dir):
            theirs = layer_of(target)
            if theirs > mine:
                found.append(
                    f"{path.relative_to(package_dir.parent)}:{line}: {name} ({LAYER_NAMES[mine]}) "
                    f"imports {target} ({LAYER_NAMES[theirs]})"
                )
    return found


# ---------------------------------------------------------------------------------------------
# Inside ops: the shared package below the two losses, the losses apart, ops' own modules on top.

OPS_ROOT = "liger_patch.ops"
OPS_PACKAGES = {
    "liger_patch.ops.core": 0,  # what every loss shares
    "liger_patch.ops.cross_entropy": 1,
    "liger_patch.ops.distillation": 1,
}
OPS_TOP = 2  # ops' own modules: its __init__, reference.py, the aliases of old paths


def ops_package(name: str) -> tuple[str, int]:
    """The ops package a module of ops belongs to and its rank (``(OPS_ROOT, OPS_TOP)`` for ops'
    own modules)."""
    for package, rank in OPS_PACKAGES.items():
        if _within(name, package):
            return package, rank
    if _within(name, OPS_ROOT):
        return OPS_ROOT, OPS_TOP
    raise AssertionError(f"{name} is not in ops")


def ops_crossings(package_dir: Path = PACKAGE_DIR) -> list[str]:
    """Every import inside ops that points up a package or across to a sibling (the two losses
    never import each other), as ``path:line: a (package) imports b (package)``."""
    found = []
    for path in sorted((package_dir / "ops").rglob("*.py")):
        name = module_name(path, package_dir)
        mine, my_rank = ops_package(name)
        source = path.read_text(encoding="utf-8")
        for line, target in imported_modules(source, name, path.name == "__init__.py", package_dir):
            if not _within(target, OPS_ROOT):
                continue
            theirs, their_rank = ops_package(target)
            if their_rank > my_rank or (their_rank == my_rank and theirs != mine):
                where = f"{path.relative_to(package_dir.parent)}:{line}"
                found.append(f"{where}: {name} ({mine}) imports {target} ({theirs})")
    return found


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Every module of the package and the package's modules it imports, at any depth."""
    graph = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name(path, package_dir)
        source = path.read_text(encoding="utf-8")
        imported = imported_modules(source, name, path.name == "__init__.py", package_dir)
        graph[name] = {target for _, target in imported if target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next((t for t in targets if t in graph), None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_higher_layer():
    found = upward_imports()
    assert not found, "imports must point down (ops <- patching <- integrations <- CLI):\n" + "\n".join(found)


def test_every_module_is_in_a_layer():
    for path in PACKAGE_DIR.rglob("*.py"):
        layer_of(module_name(path))  # raises for a module no rule classifies


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("liger_patch.env", OPS),
        ("liger_patch.ops.cross_entropy.triton.rows", OPS),
        ("liger_patch.patching.apply", PATCHING),
        ("liger_patch.verify", CLI),
        ("liger_patch.verify.sweep", CLI),
        ("liger_patch.peak_memory", CLI),
        ("liger_patch.integrations.trl", INTEGRATIONS),
        ("liger_patch.__main__", CLI),
        ("liger_patch", INTEGRATIONS),
    ],
)
def test_layer_map(name, layer):
    assert layer_of(name) == layer


UPWARD = {
    "absolute, in a function": (
        "def f():\n    import liger_patch.patching.apply\n",
        "liger_patch.patching.apply",
    ),
    "from, at the top": (
        "from liger_patch.integrations.trl import install\n",
        "liger_patch.integrations.trl",
    ),
    "from a package, a submodule": ("from liger_patch.patching import apply\n", "liger_patch.patching.apply"),
    "relative, three levels": ("from ...patching import state\n", "liger_patch.patching.state"),
    "relative, in TYPE_CHECKING": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ...integrations import trl\n",
        "liger_patch.integrations.trl",
    ),
    "the root package": ("import liger_patch as lp\n", "liger_patch"),
}


@pytest.mark.parametrize("case", list(UPWARD))
def test_an_injected_upward_import_is_found(tmp_path, case):
    """Mutation: copy the package, add one upward import to an ops module, and the check names it."""
    import shutil

    source, target = UPWARD[case]
    copy = tmp_path / "liger_patch"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    mutated = copy / "ops" / "core" / "budget.py"
    mutated.write_text(mutated.read_text(encoding="utf-8") + "\n" + source, encoding="utf-8")
    found = [line for line in upward_imports(copy) if line.startswith("liger_patch/ops/core/budget.py")]
    assert len(found) == 1 and found[0].endswith(f"imports {target} ({LAYER_NAMES[layer_of(target)]})"), found


def test_a_downward_import_is_not_flagged(tmp_path):
    import shutil

    copy = tmp_path / "liger_patch"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    mutated = copy / "integrations" / "trainer.py"
    extra = "from ..patching import apply\nfrom liger_patch import env\nimport liger_patch.ops.core.budget\n"
    mutated.write_text(mutated.read_text(encoding="utf-8") + "\n" + extra, encoding="utf-8")
    assert not [line for line in upward_imports(copy) if "integrations/trainer.py" in line]


def test_ops_packages_import_only_below_and_the_losses_apart():
    found = ops_crossings()
    assert not found, (
        "inside ops, imports must point down (core <- cross_entropy, distillation <- ops' own modules) "
        "and the two losses never import each other:\n" + "\n".join(found)
    )


def test_every_ops_module_is_in_one_ops_package():
    """Every module of ops is in core, a loss's package or ops itself; and ops itself holds at
    most 16 modules (the issue-42 target)."""
    top = []
    for path in (PACKAGE_DIR / "ops").rglob("*.py"):
        package, _ = ops_package(module_name(path))
        if package == OPS_ROOT:
            top.append(path.name)
    assert len(top) <= 16, sorted(top)


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (at any depth, function-level imports included):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def _copy(tmp_path: Path) -> Path:
    copy = tmp_path / "liger_patch"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _plant(copy: Path, module: str, source: str) -> None:
    path = copy / module
    path.write_text(path.read_text(encoding="utf-8") + "\n" + source, encoding="utf-8")


CROSSINGS = {
    "a loss imports the other": (
        "cross_entropy/rows.py",
        "from liger_patch.ops.distillation import rows as distill_rows\n",
        "liger_patch.ops.distillation.rows (liger_patch.ops.distillation)",
    ),
    "the other way, relative, in a function": (
        "distillation/chunks.py",
        "def f():\n    from ..cross_entropy import options\n",
        "liger_patch.ops.cross_entropy.options (liger_patch.ops.cross_entropy)",
    ),
    "core imports a loss": (
        "core/gemm.py",
        "from liger_patch.ops.cross_entropy.options import LossOptions\n",
        "liger_patch.ops.cross_entropy.options (liger_patch.ops.cross_entropy)",
    ),
    "core imports ops itself": (
        "core/triton/common.py",
        "from ... import reference\n",
        "liger_patch.ops.reference (liger_patch.ops)",
    ),
}


@pytest.mark.parametrize("case", list(CROSSINGS))
def test_a_planted_crossing_inside_ops_is_found(tmp_path, case):
    """Mutation: one import planted in a copy of the package, and the check names it, only it."""
    module, source, target = CROSSINGS[case]
    copy = _copy(tmp_path)
    _plant(copy, f"ops/{module}", source)
    found = ops_crossings(copy)
    assert len(found) == 1 and found[0].startswith(f"liger_patch/ops/{module}:"), found
    assert found[0].endswith(f"imports {target}"), found


def test_the_losses_importing_core_are_not_flagged(tmp_path):
    copy = _copy(tmp_path)
    _plant(
        copy, "ops/distillation/rows.py", "from liger_patch.ops.core import budget\nfrom . import chunks\n"
    )
    _plant(copy, "ops/reference.py", "from liger_patch.ops.cross_entropy import options\n")
    assert not ops_crossings(copy)


def test_a_planted_cycle_is_found(tmp_path):
    """Two modules that import each other (one of them inside a function, as the cycle this test
    was written for did), planted in a copy of the package."""
    copy = _copy(tmp_path)
    _plant(copy, "ops/core/gemm.py", "def f():\n    from liger_patch.ops.core import head_start\n")
    assert cycles(import_graph(copy)) == [["liger_patch.ops.core.gemm", "liger_patch.ops.core.head_start"]]


def test_cycles_of_a_graph_built_by_hand():
    graph = {
        "a": {"b"},
        "b": {"c", "outside"},  # an import of a module not in the graph is not an edge
        "c": {"a", "d"},
        "d": {"e"},
        "e": {"d"},
        "f": {"a"},
        "g": set(),
    }
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
