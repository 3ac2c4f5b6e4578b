"""The package's import graph: no circles, no private names crossing modules, route families apart.

Read from the source (``ast``), not by importing: every ``import`` statement counts, at module
level, under ``if TYPE_CHECKING:`` and inside functions (a lazy import that closes a circle is
still a circle: it only moves the failure to the first call). An edge goes to the module an
import names: ``from omni_engine.a import b`` is an edge to ``omni_engine.a.b`` when that is a
module, else to ``omni_engine.a``.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from dataclasses import dataclass, field

import omni_engine

PACKAGE_ROOT = pathlib.Path(omni_engine.__file__).parent

# The serving layer's rooms (``entrypoints/openai``): each imports the shared modules, never a sibling.
ROUTE_FAMILIES = ("speech", "chat_audio", "completions", "transcription", "images", "realtime", "speech_stream", "rl_routes",
                  "weight_versions")


@dataclass
class ImportGraph:
    """Modules of one package by dotted name, their import edges (with line numbers), private-name uses."""

    files: dict[str, pathlib.Path] = field(default_factory=dict)
    edges: dict[str, dict[str, int]] = field(default_factory=dict)
    # (importing module, line, module the name belongs to, name)
    private_uses: list[tuple[str, int, str, str]] = field(default_factory=list)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def read_import_graph(root: pathlib.Path) -> ImportGraph:
    """The import graph of the package at ``root`` (a directory with ``__init__.py``)."""
    graph = ImportGraph()
    package = root.name
    packages = set()
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        graph.files[".".join(parts)] = path
    for module, path in graph.files.items():
        out = graph.edges.setdefault(module, {})
        # Names bound to a module of the package (import a.b as m; from a import b): m._x is a private use.
        module_aliases: dict[str, str] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in graph.files:
                        out.setdefault(alias.name, node.lineno)
                        if alias.asname:
                            module_aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                base = module.split(".") if module in packages else module.split(".")[:-1]
                if node.level:
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != package:
                    continue
                for alias in node.names:
                    submodule = f"{target}.{alias.name}"
                    if submodule in graph.files:
                        out.setdefault(submodule, node.lineno)
                        module_aliases[alias.asname or alias.name] = submodule
                        continue
                    out.setdefault(target, node.lineno)
                    if _is_private(alias.name) and target != module:
                        graph.private_uses.append((module, node.lineno, target, alias.name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in module_aliases and _is_private(node.attr)
                    and module_aliases[node.value.id] != module):
                graph.private_uses.append((module, node.lineno, module_aliases[node.value.id], node.attr))
        out.pop(module, None)
    return graph


def import_circles(graph: ImportGraph) -> list[list[str]]:
    """Every set of modules that import one another (Tarjan's strongly connected components, > 1 module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative: the package is deep enough that recursion would be a risk for nothing.
        work = [(start, iter(graph.edges.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.edges.get(target, ()))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                        circles.append(sorted(component))

    for module in graph.edges:
        if module not in index:
            visit(module)
    return circles


def _describe(graph: ImportGraph, circle: list[str]) -> str:
    members = set(circle)
    return "; ".join(f"{m} -> {t} (line {line})" for m in circle
                     for t, line in graph.edges[m].items() if t in members)


def test_the_package_has_no_import_circle_and_no_private_name_crosses_a_module():
    graph = read_import_graph(PACKAGE_ROOT)
    assert len(graph.files) > 150 and "omni_engine.entrypoints.openai.served_pipeline" in graph.files
    circles = import_circles(graph)
    assert circles == [], "import circles: " + " | ".join(_describe(graph, c) for c in circles)
    assert graph.private_uses == [], "private names imported from another module: " + ", ".join(
        f"{m}:{line} uses {owner}.{name}" for m, line, owner, name in graph.private_uses)


def test_route_families_build_on_the_shared_modules_and_never_on_each_other():
    graph = read_import_graph(PACKAGE_ROOT)
    families = {f"omni_engine.entrypoints.openai.{name}" for name in ROUTE_FAMILIES}
    assert families <= set(graph.files), sorted(families - set(graph.files))
    crossings = [(m, t) for m in families for t in graph.edges[m] if t in families]
    assert crossings == [], f"a route family imports another: {crossings}"
    # The one registrar: app imports every family that has a router of its own.
    from omni_engine.entrypoints.openai import app

    registered = {f.__name__ for f in app.ROUTE_FAMILIES}
    assert registered == families - {"omni_engine.entrypoints.openai.rl_routes",
                                     "omni_engine.entrypoints.openai.weight_versions"}
    assert set(graph.edges["omni_engine.entrypoints.openai.app"]) >= families
    shared = "omni_engine.entrypoints.openai.served_pipeline"
    assert all(shared in graph.edges[f] for f in families - {"omni_engine.entrypoints.openai.rl_routes",
                                                             "omni_engine.entrypoints.openai.weight_versions"})


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_the_walk_finds_planted_circles_and_private_names(tmp_path):
    """The checks above can fail: a circle closed only under TYPE_CHECKING, one closed by a lazy
    import in a function, one through relative imports, and private names taken two ways."""
    root = _package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "from pkg.a import thing as _alias\n",
        "c.py": "def f():\n    from pkg import d\n    return d\n",
        "d.py": "import pkg.c\n",
        "sub/__init__.py": "",
        "sub/e.py": "from . import f\n",
        "sub/f.py": "from .e import _hidden\n",
        "g.py": "from pkg.a import _secret\nimport pkg.b as bee\nbee._x\nfrom pkg.sub import e\ne._y\n",
        "h.py": "_mine = 1\nfrom pkg.h import _mine\nimport os\nos._exit\n",
    })
    graph = read_import_graph(root)
    assert sorted(import_circles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"], ["pkg.sub.e", "pkg.sub.f"]]
    assert sorted((m, owner, name) for m, _line, owner, name in graph.private_uses) == [
        ("pkg.g", "pkg.a", "_secret"), ("pkg.g", "pkg.b", "_x"), ("pkg.g", "pkg.sub.e", "_y"),
        ("pkg.sub.f", "pkg.sub.e", "_hidden")]
    assert "_alias" not in {name for *_rest, name in graph.private_uses}  # an alias is not the name imported
