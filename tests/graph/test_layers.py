"""The IR stands at the bottom: nothing under graph/ imports kernels/, passes/ or runtime/.

Read from the source (every import statement, at module level or inside a function, absolute or
relative), so that a lazy import inside a function body is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import megagraph.graph

GRAPH = Path(megagraph.graph.__file__).resolve().parent
ABOVE = ("kernels", "passes", "runtime")


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `path`, a module of the megagraph.graph
    package whose folder is `root`."""
    rel = path.relative_to(root).with_suffix("")
    package = ["megagraph", "graph", *rel.parts[:-1]]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            out += [(node.lineno, f"{mod}.{a.name}" if not node.module and node.level else mod)
                    for a in node.names]
    return out


def violations(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        for line, mod in imported_modules(path, root):
            parts = mod.split(".")
            if parts[0] == "megagraph" and len(parts) > 1 and parts[1] in ABOVE:
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {mod}")
    return bad


def test_graph_imports_nothing_above_it():
    assert not violations(GRAPH), "\n".join(violations(GRAPH))


def test_the_walk_sees_relative_and_lazy_imports(tmp_path):
    """The check itself: a relative import out of graph/ and one inside a function both count."""
    fake = tmp_path / "graph"
    (fake / "sub").mkdir(parents=True)
    (fake / "ok.py").write_text("from .types import DTYPES\nimport torch\n")
    (fake / "sub" / "bad.py").write_text("from ...kernels.registry import KERNELS\n")
    (fake / "lazy.py").write_text("def f():\n    from megagraph.runtime import plan\n")
    got = violations(fake)
    assert got == ["graph/lazy.py:2 imports megagraph.runtime",
                   "graph/sub/bad.py:1 imports megagraph.kernels.registry"]
