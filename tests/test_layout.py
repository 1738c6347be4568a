"""The package's shape: imports go one way between its folders, nothing imports in a circle,
kernels/ stands alone, no module outgrows one job, and every package folder installs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Each folder's place: a module may import from its own folder and from folders ranked below
# its own, never from one ranked level or above (errors, files < config < model, dist, pycache <
# metrics < data, step < run < commands < __main__). kernels/ installs as fasttrain.kernels.
RANK = {
    "errors": 0,
    "files": 0,
    "config": 1,
    "kernels": 1,
    "model": 2,
    "dist": 2,
    "pycache": 2,
    "metrics": 3,
    "data": 4,
    "step": 4,
    "run": 5,
    "envreport": 5,
    "commands": 6,
    "__main__": 7,
}
MAX_LINES = 450


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = ["fasttrain", *rel.parts] if rel.parts[0] == "kernels" else list(rel.parts)
    parts[-1] = parts[-1].removesuffix(".py")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    return sorted([*REPO.glob("fasttrain/**/*.py"), *REPO.glob("kernels/*.py")])


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only, never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def imports() -> dict[str, set[str]]:
    """Each module's fasttrain imports, those inside functions included; a name imported from
    a module counts as that module."""
    modules = {module_name(p) for p in sources()}
    found: dict[str, set[str]] = {}
    for path in sources():
        me = module_name(path)
        targets: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # kernels' relative imports
                targets.add(me.rsplit(".", node.level)[0] + f".{node.module}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fasttrain"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("fasttrain")}
        found[me] = targets - {me, "fasttrain"}
    return found


def folder(module: str) -> str:
    return module.split(".")[1]


def test_imports_go_one_way_between_folders():
    wrong = [
        f"{m} imports {t}"
        for m, targets in imports().items()
        if m != "fasttrain"
        for t in targets
        if folder(t) != folder(m) and RANK[folder(t)] >= RANK[folder(m)]
    ]
    assert wrong == []


def test_kernels_import_nothing_of_fasttrain():
    outside = {
        f"{m} imports {t}"
        for m, targets in imports().items()
        if m != "fasttrain" and folder(m) == "kernels"
        for t in targets
        if folder(t) != "kernels"
    }
    assert outside == set()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph``, as the modules along it, or None."""
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for target in sorted(graph.get(module, ())):
            if found := visit(target, (*path, module)):
                return found
        done.add(module)
        return None

    return next(filter(None, (visit(m, ()) for m in sorted(graph))), None)


def test_no_import_cycle():
    assert find_cycle(imports()) is None


def test_the_walk_sees_function_level_imports_and_cycles():
    graph = imports()
    assert "fasttrain.step.plan" in graph["fasttrain.run.resume"]  # a module-level import
    assert "fasttrain.data.sample" in graph["fasttrain.commands.train"]  # one in a function
    assert "fasttrain.config.parse" not in graph["fasttrain.config.schema"]  # TYPE_CHECKING
    planted = {
        **graph,
        "fasttrain.step.plan": graph["fasttrain.step.plan"] | {"fasttrain.run.resume"},
    }
    cycle = find_cycle(planted)
    assert cycle[0] == cycle[-1] and set(cycle) == {"fasttrain.run.resume", "fasttrain.step.plan"}


def test_no_module_outgrows_one_job():
    long = {
        str(p.relative_to(REPO)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_every_package_folder_installs():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    folders = {module_name(p.parent / "__init__.py") for p in REPO.glob("fasttrain/**/__init__.py")}
    assert folders <= listed
    assert {"fasttrain.kernels", "fasttrain.configs"} <= listed
