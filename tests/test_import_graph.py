"""minifsdp's imports run one way, through the layers of DESIGN.md, with no cycle.

The graph is read from the source with ``ast``: every ``import`` and ``from ...
import`` anywhere in a file (module level, inside functions, under
``TYPE_CHECKING``), relative or absolute. An edge ``a -> b`` means module ``a``
imports module ``b``; importing ``pkg.sub`` also runs ``pkg/__init__.py``, so
that is an edge too. Two rules:

1. no module imports a module of a *later* layer (``LAYERS`` below, DESIGN.md's
   order); inside a layer anything goes, as long as
2. the graph has no cycle, between modules and between the top-level parts
   (``fsdp`` may use ``mixed_precision`` or the reverse, not both).

To add a file or a package, add its top-level name to its layer in ``LAYERS``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import minifsdp

# DESIGN.md's layers, first to last: a module imports only from its own layer or an earlier one.
LAYERS: list[tuple[str, set[str]]] = [
    # "": minifsdp/__init__.py, which re-exports launch
    ("runtime", {"", "dist", "launch", "fake_gpu", "faults", "flight_recorder"}),
    ("recording", {"trace", "memory", "phases"}),
    ("communication", {"comm"}),
    ("leaves", {"models", "data", "estimate", "planner", "parallel_bytes", "layout", "step_time"}),
    ("techniques", {"ddp", "zero", "fsdp", "mixed_precision", "checkpoint", "pipeline", "tensor_parallel", "mesh",
                    "context_parallel", "expert_parallel"}),
    ("front", {"train", "bench", "bench_report", "bench_sides", "demo", "plot", "labcheck", "widgets", "torch_reference", "__main__", "records",
               "strategies", "calibrate", "save_resume"}),
]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """``minifsdp.fsdp.wrap`` -> its file, for every ``.py`` file under ``root`` (the package folder)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of ``known`` that one import statement names (a name imported *from* a module
    counts as that module unless it is itself a submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports (parents of a submodule included)."""
    files = module_names(root, package)
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, module, path.name == "__init__.py", known):
                while target and target not in known:  # `import pkg.mod.Name`-like: the nearest module
                    target = target.rpartition(".")[0]
                if not target or target == module:
                    continue
                graph[module].add(target)
                parent = target.rpartition(".")[0]
                while parent and not (module == parent or module.startswith(parent + ".")):
                    graph[module].add(parent)  # importing a.b runs a/__init__.py first
                    parent = parent.rpartition(".")[0]
    return graph


def part(module: str, package: str) -> str:
    """The top-level part of the package a module belongs to: minifsdp.fsdp.wrap -> "fsdp"."""
    rest = module[len(package):].lstrip(".")
    return rest.split(".")[0]


def layer_of(module: str, package: str, layers: list[tuple[str, set[str]]]) -> int:
    name = part(module, package)
    for i, (_, members) in enumerate(layers):
        if name in members:
            return i
    raise KeyError(name)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first search, colouring nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path for each group of nodes that reach each other (a strongly connected component)."""
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    groups = {frozenset(m for m in reach[n] if n in reach.get(m, ())) for n in graph if n in reach[n]}
    return sorted(find_cycle({n: graph[n] & g for n in g}) for g in groups)


def violations(root: Path, package: str, layers: list[tuple[str, set[str]]]) -> list[str]:
    """Every broken rule, as one readable line each (empty: the imports run one way)."""
    graph = import_graph(root, package)
    problems = []
    if unplaced(root, package, layers):
        return unplaced(root, package, layers)
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            a, b = layer_of(module, package, layers), layer_of(target, package, layers)
            if b > a:
                problems.append(f"{module} ({layers[a][0]}) imports {target} ({layers[b][0]}), a later layer")
    problems += ["import cycle between modules: " + " -> ".join(c) for c in cycles(graph)]
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        parts.setdefault(part(module, package), set()).update(
            part(t, package) for t in targets if part(t, package) != part(module, package))
    problems += ["import cycle between parts of the package: " + " -> ".join(c) for c in cycles(parts)]
    return problems


def unplaced(root: Path, package: str, layers: list[tuple[str, set[str]]]) -> list[str]:
    """One sentence for each top-level module or package that no layer lists."""
    placed = {n for _, members in layers for n in members}
    return [f"{package}.{n} is in no layer: add it to LAYERS in tests/test_import_graph.py (DESIGN.md says which)"
            for n in sorted({part(m, package) for m in module_names(root, package)} - placed)]


def test_every_top_level_module_has_a_layer():
    """fake_gpu with the runtime, planner (and layout) with the leaves, torch_reference with the front..."""
    assert not unplaced(Path(minifsdp.__file__).parent, "minifsdp", LAYERS), \
        "\n".join(unplaced(Path(minifsdp.__file__).parent, "minifsdp", LAYERS))


def test_minifsdp_imports_run_one_way():
    root = Path(minifsdp.__file__).parent
    problems = violations(root, "minifsdp", LAYERS)
    assert not problems, "\n".join(problems)


def test_the_graph_sees_function_level_and_relative_imports():
    graph = import_graph(Path(minifsdp.__file__).parent, "minifsdp")
    assert "minifsdp.fsdp" in graph["minifsdp.strategies"]  # `from .fsdp import ...` inside a function
    assert "minifsdp.comm" in graph["minifsdp.fsdp.flat_param"]  # `from .. import comm`
    assert "minifsdp.fsdp.wrap" in graph["minifsdp.fsdp"]  # `from . import wrap`: a submodule, not a name


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


FAKE_LAYERS = [("low", {"", "low"}), ("mid", {"a", "b"}), ("high", {"top"})]


def test_an_upward_import_inside_a_function_is_caught(tmp_path):
    root = _fake_package(tmp_path, {"low.py": "def f():\n    from .top import g\n", "top.py": "from . import low\n"})
    problems = violations(root, "pkg", FAKE_LAYERS)
    assert problems[0] == "pkg.low (low) imports pkg.top (high), a later layer"


def test_a_cycle_held_by_a_function_level_import_is_caught(tmp_path):
    root = _fake_package(tmp_path, {"a/__init__.py": "", "a/x.py": "from ..b import y\n",
                                    "b/__init__.py": "", "b/y.py": "def f():\n    import pkg.a.x\n"})
    problems = violations(root, "pkg", FAKE_LAYERS)
    assert problems == ["import cycle between modules: pkg.a.x -> pkg.b.y -> pkg.a.x",
                        "import cycle between parts of the package: a -> b -> a"]


def test_a_cycle_between_parts_only_is_caught(tmp_path):
    root = _fake_package(tmp_path, {"a/__init__.py": "", "a/x.py": "from ..b.y import f\n", "a/z.py": "",
                                    "b/__init__.py": "", "b/y.py": "from ..a import z\n"})
    assert violations(root, "pkg", FAKE_LAYERS) == ["import cycle between parts of the package: a -> b -> a"]


@pytest.mark.parametrize("files, expected", [
    ({"new.py": ""}, ["pkg.new is in no layer: add it to LAYERS in tests/test_import_graph.py (DESIGN.md says which)"]),
    ({"newpkg/__init__.py": "", "newpkg/x.py": ""},
     ["pkg.newpkg is in no layer: add it to LAYERS in tests/test_import_graph.py (DESIGN.md says which)"]),
    ({"a.py": "import os\nfrom typing import Any\nfrom . import low\n", "low.py": ""}, []),
])
def test_unplaced_modules_and_clean_packages(tmp_path, files, expected):
    assert violations(_fake_package(tmp_path, files), "pkg", FAKE_LAYERS) == expected
