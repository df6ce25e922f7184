"""The translator layer stays a layer: torch-free, importing only downwards, with no cycle.

Every import is counted, wherever it is written (inside functions, under
TYPE_CHECKING), as are strings that name zerobridge modules (importlib).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zerobridge"
LAYER = [*sorted((PACKAGE / "translate").glob("*.py")), PACKAGE / "load.py", PACKAGE / "diff.py",
         PACKAGE / "registry.py"]
BELOW = ("zerobridge.errors", "zerobridge.resources", "zerobridge.spec")
NAMED = re.compile(r"^(zerobridge(?:\.\w+)+)(?::\w+)?$")


def name_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported name, at module top) for every import and module-naming string in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in tree.body}
    found: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{alias.name}", id(node) in top) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED.match(node.value):
            found.append((NAMED.match(node.value).group(1), False))  # type: ignore[union-attr]
    return found


def own(name: str) -> str | None:
    """The module of the layer ``name`` is, or lies in."""
    layer = {name_of(p) for p in LAYER}
    while name and name not in layer:
        name = name.rpartition(".")[0]
    return name or None


def test_the_layer_imports_no_torch_and_nothing_above_it() -> None:
    for path in LAYER:
        for name, at_top in imports(path):
            assert name.split(".")[0] != "torch" or "translate" not in path.parts, f"{path.name}: {name}"
            if name.startswith("zerobridge."):
                assert name.startswith(BELOW) or own(name), f"{name_of(path)} imports {name} from above its layer"
                assert at_top, f"{name_of(path)} imports {name} inside a function, under a condition or by name"


def test_the_bottom_layers_import_nothing_above_them() -> None:
    for name, _ in imports(PACKAGE / "errors.py"):
        assert not name.startswith("zerobridge"), f"errors imports {name}"
    for path in (PACKAGE / "spec").glob("*.py"):
        for name, _ in imports(path):
            assert not name.startswith("zerobridge") or name.startswith("zerobridge.spec"), f"{path.name}: {name}"


def test_the_layer_has_no_import_cycle() -> None:
    graph = {name_of(p): {own(n) for n, _ in imports(p)} - {None, name_of(p)} for p in LAYER}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join([*path[path.index(node):], node])}"
        if node in done:
            return
        for nxt in graph.get(node, ()):
            visit(nxt, [*path, node])  # type: ignore[arg-type]
        done.add(node)

    for start in graph:
        visit(start, [])
