"""The import graph docs/design.md describes: no cycle among spec_adapt's modules, and spec_adapt.tools (the command
line and the harnesses) imported by nothing outside it. Every import counts, the ones inside functions included: a
cycle hidden in a function still makes two modules one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spec_adapt"
TOOLS = "spec_adapt.tools"
# docs/design.md's first layer.
FOUNDATIONS = [f"spec_adapt.{name}" for name in ("compat", "metrics", "acceptance_rules", "noise", "tree",
                                                  "running_estimates", "model_kinds", "loading", "execution", "identity",
                                                  "kernels", "kernels.compact", "kernels.verify")]


def modules(root: Path) -> dict[str, Path]:
    """Every module under the package folder `root`, by its dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known) -> set[str]:
    """The modules of `known` that `path` (module `name`) imports anywhere in its body. `from P import x` names the
    module P.x when there is one, else P itself; the package a submodule sits in is not counted."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{source}.{alias.name}" for alias in node.names} & set(known)
            out |= submodules
            if len(submodules) < len(node.names) and source in known:
                out.add(source)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(root)
    return {name: imported(name, path, found) for name, path in found.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, colouring the modules on the path)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def tools_importers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    inside = lambda m: m == TOOLS or m.startswith(TOOLS + ".")   # noqa: E731
    return sorted((m, t) for m, targets in graph.items() if not inside(m) for t in targets if inside(t))


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "spec_adapt.loop" in graph["spec_adapt.api"]
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_foundations_import_nothing_of_spec_adapt_but_compat():
    """compat names every transformers and torch internal spec_adapt touches, so the other foundations may read it;
    compat itself imports nothing of spec_adapt."""
    graph = import_graph()
    for module in FOUNDATIONS:
        allowed = set() if module == "spec_adapt.compat" else {"spec_adapt.compat"}
        assert module in graph and not graph[module] - allowed, (module, sorted(graph.get(module, ())))


def test_nothing_outside_the_tools_imports_them():
    assert tools_importers(import_graph()) == []


def test_the_checks_see_lazy_relative_and_package_imports(tmp_path):
    """The checks themselves, on a package made for the purpose: a cycle closed by an import inside a function, and a
    core module importing the tools, are both found."""
    root = tmp_path / "spec_adapt"
    (root / "tools").mkdir(parents=True)
    files = {"__init__.py": "from .a import f\n", "a.py": "from . import b\n\ndef f():\n    return b\n",
             "b.py": "def g():\n    from .a import f\n    return f\n", "c.py": "from .tools.cli import main\n",
             "tools/__init__.py": "", "tools/cli.py": "import spec_adapt.a\n\ndef main():\n    pass\n"}
    for name, text in files.items():
        (root / name).write_text(text)
    graph = import_graph(root)
    assert cycle(graph) in (["spec_adapt.a", "spec_adapt.b", "spec_adapt.a"],
                            ["spec_adapt.b", "spec_adapt.a", "spec_adapt.b"])
    assert tools_importers(graph) == [("spec_adapt.c", "spec_adapt.tools.cli")]

