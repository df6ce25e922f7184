"""The package is layered: every import looks down the order in ``zerobridge/__init__.py``, and none closes a cycle.

Every import counts, wherever it is written: at module top, inside a
function, under ``if TYPE_CHECKING:``, and strings that name a zerobridge
module (``importlib.import_module("zerobridge.x")``, ``"zerobridge.x:fn"``
targets that a worker imports). An import inside a function is allowed only
where it keeps a heavy dependency off the importer's start-up: the imported
module loads torch (or deepspeed, transformers, accelerate, matplotlib) at
its top and the importing module does not, and the line says why in a
comment. Nothing else may hide an edge, so a cycle cannot be dodged.

The walk is plain ``ast`` over files (nothing is imported), so the rules are
checked the same way on a fixture tree in the tests at the bottom.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import zerobridge

PACKAGE = Path(zerobridge.__file__).resolve().parent

NAMED = re.compile(r"^(zerobridge(?:\.\w+)+)(?::\w+)?$")
HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "matplotlib", "safetensors",
         "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")
"""Third-party packages (or torch's parts: DCP, DTensor and FSDP2 load sympy and DTensor's op tables, about
2 s per process) whose import costs start-up time: reasons for an import inside a function."""


def _heavy(names: set[str]) -> set[str]:
    """The ``HEAVY`` entries that importing ``names`` (dotted module names) loads."""
    return {h for h in HEAVY for n in names if n == h or n.startswith(h + ".")}
TORCH_FREE = ("zerobridge.errors", "zerobridge.spec", "zerobridge.env", "zerobridge.translate", "zerobridge.registry",
              "zerobridge.load", "zerobridge.diff", "zerobridge.explain", "zerobridge._version", "zerobridge.resources")
"""Modules that never import torch, not even inside a function: config conversion stays fast."""


@dataclass(frozen=True)
class Edge:
    """One import of ``target`` (a module or a package) by ``source``."""

    source: str
    target: str
    line: int
    where: str
    """``top``, ``function``, ``type_checking`` or ``string``."""
    comment: str = ""
    """The comment on the import's line, or on the line above it."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` by its dotted name."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` is, or the one it lies in (``pkg.mod.symbol`` -> ``pkg.mod``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _where(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    kind = "top"
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return "function"
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            kind = "type_checking"
    return kind


def edges(source: str, path: Path, known: dict[str, Path]) -> tuple[list[Edge], list[str]]:
    """The internal imports of one module, and the external top-level packages it imports (anywhere)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found: list[Edge] = []
    external: list[str] = []

    def comment(node: ast.AST) -> str:
        first, last = node.lineno, getattr(node, "end_lineno", None) or node.lineno  # type: ignore[attr-defined]
        for text_line in [*lines[first - 1:last], lines[first - 2] if first > 1 else ""]:
            if "#" in text_line:
                return text_line.split("#", 1)[1].strip()
        return ""

    def add(name: str, node: ast.AST, where: str | None = None) -> None:
        if name.split(".")[0] != "zerobridge":
            external.append(name)
            return
        target = _resolve(name, known)
        if target is not None and target != source:
            found.append(Edge(source, target, node.lineno, where or _where(node, parents),  # type: ignore[attr-defined]
                              comment(node)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                add(full if full in known else base, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = NAMED.match(node.value)
            if match and match.group(1) in known:  # only a string that names a module exactly
                add(match.group(1), node, "string")
        elif isinstance(node, ast.JoinedStr):
            head = node.values[0] if node.values else None
            if isinstance(head, ast.Constant) and str(head.value).startswith("zerobridge."):
                found.append(Edge(source, f"<dynamic {head.value}...>", node.lineno, "dynamic"))
    return list(dict.fromkeys(found)), external


@dataclass
class Graph:
    known: dict[str, Path]
    edges: list[Edge]
    external: dict[str, set[str]]
    """Module -> third-party modules it imports anywhere (dotted names)."""
    external_top: dict[str, set[str]]
    """Module -> third-party modules it imports at its top (dotted names)."""


def build(root: Path) -> Graph:
    known = modules(root)
    all_edges: list[Edge] = []
    external: dict[str, set[str]] = {}
    external_top: dict[str, set[str]] = {}
    for name, path in known.items():
        found, ext = edges(name, path, known)
        all_edges += found
        external[name] = set(ext)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                top.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top.add(node.module)
        external_top[name] = {n for n in top if n.split(".")[0] != "zerobridge"}
    return Graph(known, all_edges, external, external_top)


def layer_order() -> list[list[str]]:
    """The layers, bottom first, as ``zerobridge/__init__.py`` states them (``LAYERS``)."""
    return [list(layer) for layer in zerobridge.LAYERS]


def layer_of(module: str, layers: list[list[str]]) -> tuple[int, str] | None:
    """(layer index, the group inside it) of ``module``: the longest prefix that names it."""
    best: tuple[int, str] | None = None
    for index, layer in enumerate(layers):
        for prefix in layer:
            names_it = module == prefix or ("." in prefix and module.startswith(prefix + "."))
            if names_it and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    return best


def _loaded_at_top(graph: Graph) -> dict[str, set[str]]:
    """Module -> every third-party package importing it (at module top, following internal top imports) loads."""
    top_edges: dict[str, set[str]] = {m: set() for m in graph.known}
    for e in graph.edges:
        if e.where == "top":
            top_edges[e.source].add(e.target)
    for module in graph.known:  # importing a module runs every package __init__ above it
        parts = module.split(".")
        top_edges[module].update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) != module)
    memo: dict[str, set[str]] = {}

    def closure(module: str, seen: frozenset[str]) -> set[str]:
        if module in memo:
            return memo[module]
        found = set(graph.external_top.get(module, set()))
        for target in top_edges.get(module, ()):
            if target not in seen:
                found |= closure(target, seen | {target})
        memo[module] = found
        return found

    return {m: closure(m, frozenset({m})) for m in graph.known}


def violations(graph: Graph, layers: list[list[str]], torch_free: tuple[str, ...] = TORCH_FREE) -> list[str]:
    """Every rule broken, one line each."""
    problems: list[str] = []
    for module in graph.known:
        if layer_of(module, layers) is None:
            problems.append(f"{module} is in no layer: add it to zerobridge.LAYERS")
    loaded = _loaded_at_top(graph)
    for e in graph.edges:
        if e.where == "dynamic":
            problems.append(f"{e.source}:{e.line} imports a module named by a built string ({e.target}): "
                            "use a table of imported names")
            continue
        here, there = layer_of(e.source, layers), layer_of(e.target, layers)
        if here is None or there is None:
            continue
        if there[0] > here[0]:
            problems.append(f"{e.source}:{e.line} imports {e.target} ({e.where}), a layer above it")
        elif there[0] == here[0] and there[1] != here[1] and len(layers[here[0]]) > 1 and here[0] in _INDEPENDENT:
            problems.append(f"{e.source}:{e.line} imports {e.target}: the groups of this layer are independent")
        if e.where == "function":
            heavy = _heavy(loaded.get(e.target, set()) | graph.external_top.get(e.target, set()))
            heavy -= _heavy(loaded.get(e.source, set()))
            if not heavy:
                problems.append(f"{e.source}:{e.line} imports {e.target} inside a function, and that spares no "
                                "heavy import: import it at module top")
            elif not e.comment:
                problems.append(f"{e.source}:{e.line} imports {e.target} inside a function: say why on the line "
                                f"(it loads {', '.join(sorted(heavy))})")
    for module, packages in graph.external.items():
        if module.startswith(torch_free) and _heavy(packages):
            problems.append(f"{module} imports {', '.join(sorted(_heavy(packages)))}: it must stay torch-free")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


_INDEPENDENT: set[int] = set()
"""Layers whose groups may not import one another (filled from ``zerobridge.INDEPENDENT``)."""


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (as a path) per strongly connected component of more than one module."""
    adjacency: dict[str, set[str]] = {m: set() for m in graph.known}
    for e in graph.edges:
        if e.target in adjacency:
            adjacency[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(adjacency[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_in(sorted(component), adjacency))

    for v in sorted(adjacency):
        if v not in index:
            connect(v)
    return found


def _path_in(component: list[str], adjacency: dict[str, set[str]]) -> list[str]:
    """A cycle through the first module of ``component``, for the message."""
    start, members = component[0], set(component)
    path, seen = [start], {start}
    while True:
        nxt = next((w for w in sorted(adjacency[path[-1]]) if w in members and (w == start or w not in seen)), None)
        if nxt is None or nxt == start:
            return [*path, start]
        path.append(nxt)
        seen.add(nxt)


# ----------------------------------------------------------------------------- the package itself


def _layers() -> list[list[str]]:
    _INDEPENDENT.clear()
    _INDEPENDENT.update(zerobridge.INDEPENDENT)
    return layer_order()


def test_the_package_is_layered_without_cycles() -> None:
    problems = violations(build(PACKAGE), _layers())
    assert not problems, "\n".join(problems)


def test_every_layer_is_named_once() -> None:
    prefixes = [p for layer in _layers() for p in layer]
    assert len(prefixes) == len(set(prefixes)), "a module prefix is in two layers"


# ----------------------------------------------------------------------------- the test of the test


def _tree(root: Path, files: dict[str, str]) -> Path:
    package = root / "zerobridge"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return package


FIXTURE_LAYERS = [["zerobridge.spec"], ["zerobridge.engine", "zerobridge.checkpoint"], ["zerobridge.api"],
                  ["zerobridge"]]


def _check(tmp_path: Path, files: dict[str, str], independent: set[int] | None = None) -> list[str]:
    tmp_path = tmp_path / f"tree{len(list(tmp_path.iterdir()))}"  # a fresh tree per check
    _INDEPENDENT.clear()
    _INDEPENDENT.update(independent or set())
    try:
        return violations(build(_tree(tmp_path, files)), FIXTURE_LAYERS, torch_free=("zerobridge.spec",))
    finally:
        _INDEPENDENT.clear()


def test_a_clean_fixture_passes(tmp_path: Path) -> None:
    assert _check(tmp_path, {"spec/a.py": "X = 1\n", "engine/e.py": "from zerobridge.spec.a import X\n",
                             "api.py": "import zerobridge.engine.e\n"}) == []


@pytest.mark.parametrize("where", ["top", "function", "type_checking", "string"])
def test_an_upward_import_fails_wherever_it_is_written(tmp_path: Path, where: str) -> None:
    body = {"top": "from zerobridge.api import f\n",
            "function": "def g():\n    from zerobridge.api import f  # lazy: loads torch\n    return f\n",
            "type_checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from zerobridge.api import f\n",
            "string": "TARGET = 'zerobridge.api:f'\n"}[where]
    found = _check(tmp_path, {"spec/a.py": body, "api.py": "import torch\ndef f():\n    pass\n"})
    assert any("zerobridge.spec.a" in p and "a layer above it" in p for p in found), found


def test_a_cycle_fails(tmp_path: Path) -> None:
    found = _check(tmp_path, {"engine/a.py": "def f():\n    from zerobridge.engine.b import g  # x\n",
                              "engine/b.py": "from zerobridge.engine.a import f\n"})
    assert any(p.startswith("import cycle: zerobridge.engine.a -> zerobridge.engine.b") for p in found), found


def test_a_function_import_that_spares_nothing_fails(tmp_path: Path) -> None:
    files = {"spec/a.py": "X = 1\n", "engine/e.py": "def f():\n    from zerobridge.spec.a import X  # why\n"}
    assert any("spares no heavy import" in p for p in _check(tmp_path, files))
    files = {"engine/heavy.py": "import torch\n", "api.py": "def f():\n    from zerobridge.engine import heavy\n"}
    assert any("say why on the line" in p for p in _check(tmp_path, files))
    files["api.py"] = "def f():\n    from zerobridge.engine import heavy  # lazy: loads torch\n"
    assert _check(tmp_path, files) == []


def test_independent_groups_and_torch_free_layers(tmp_path: Path) -> None:
    files = {"checkpoint/c.py": "X = 1\n", "engine/e.py": "from zerobridge.checkpoint.c import X\n"}
    assert _check(tmp_path, files) == []
    assert any("independent" in p for p in _check(tmp_path, files, independent={1}))
    found = _check(tmp_path, {"spec/s.py": "def f():\n    import torch  # fast\n"})
    assert any("torch-free" in p for p in found)


def test_a_built_module_name_and_an_unplaced_module_fail(tmp_path: Path) -> None:
    found = _check(tmp_path, {"api.py": "import importlib\ndef f(n):\n    return importlib.import_module("
                                        "f'zerobridge.engine.{n}')\n", "extra/x.py": "X = 1\n"})
    assert any("built string" in p for p in found) and any("zerobridge.extra" in p and "no layer" in p for p in found)
