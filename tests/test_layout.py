"""The package's layout: sub-packages in the order data flows, read statically from the source.

Every module of ``src/autopar`` belongs to one *stage*, named by its sub-package (a module at the
top of the package is in ``top``), and the stages are ordered as data flows through them:

    ir < machine < cost < capture < schedule < passes < runtime < distributed < report < doctor
       < top < bench < cli

``passes`` comes after ``schedule``: its choices are made by placing and simulating (fusion keeps
the faster of two simulated plans, data parallelism the fastest of its shards).

Rules (each import counts, at module level or inside a function; imports under
``if TYPE_CHECKING:`` never run and are skipped):

- No import cycle between modules.
- A module imports modules of its own stage or of earlier ones only; ``ir`` imports nothing of
  autopar outside ``ir``.
- ``runtime`` is mechanism: it obeys plans and decides nothing. From ``schedule`` it imports
  only the data it obeys and writes (:data:`RUNTIME_DATA`: the plan's steps, the timeline, the
  rules of its CUDA-graph segments), and
  nothing it reaches, however indirectly, is in ``passes``, ``cost``, or the rest of
  ``schedule`` (placement, planning, simulation).
- An import inside a function (an optional dependency, or a module heavy to import at start-up)
  says why on its line, in a ``# ...`` comment.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE = "autopar"
SOURCE = Path(__file__).resolve().parents[1] / "src" / PACKAGE
STAGES = ("ir", "machine", "cost", "capture", "schedule", "passes", "runtime", "distributed",
          "report",
          "doctor", "top", "bench", "cli")
RUNTIME_DATA = frozenset({"autopar.schedule.steps", "autopar.schedule.timeline",
                          "autopar.schedule.segments"})
RUNTIME_NEVER = ("passes", "cost", "schedule")  # outside RUNTIME_DATA


# -- reading the source --------------------------------------------------------------------------
def modules(root: Path = SOURCE) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> Iterable[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement that runs, with whether it is inside a function."""
    def walk(node: ast.AST, in_function: bool) -> Iterable[tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                yield from ((s, f) for n in child.orelse for s, f in walk_one(n, in_function))
                continue
            yield from walk_one(child, in_function)

    def walk_one(node: ast.AST, in_function: bool) -> Iterable[tuple[ast.AST, bool]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function
            return
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef |
                                          ast.Lambda)
        yield from walk(node, inner)

    yield from walk(tree, False)  # type: ignore[misc]


def targets(stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool,
            known: Mapping[str, Path] | set[str]) -> list[str]:
    """The autopar modules ``stmt`` (in ``module``) imports: relative imports resolved, and
    ``from package import submodule`` counted as the submodule."""
    if isinstance(stmt, ast.Import):
        names = [a.name for a in stmt.names]
        return [_known_prefix(n, known) for n in names if n.split(".")[0] == PACKAGE]
    if stmt.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (stmt.level - 1)]
        source = ".".join(base + ([stmt.module] if stmt.module else []))
    else:
        source = stmt.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    out = []
    for alias in stmt.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in known else _known_prefix(source, known))
    return list(dict.fromkeys(out))


def _known_prefix(name: str, known: Mapping[str, Path] | set[str]) -> str:
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) or name


def import_graph(files: Mapping[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """module -> the autopar modules it imports; and the in-function imports without a reason
    comment on their line (``"path:line: statement"``)."""
    edges: dict[str, set[str]] = {m: set() for m in files}
    unexplained = []
    for module, path in files.items():
        text = path.read_text()
        lines = text.splitlines()
        for stmt, in_function in _imports(ast.parse(text, str(path))):
            found = targets(stmt, module, _is_package(path), files)
            edges[module].update(t for t in found if t != module)
            span = lines[stmt.lineno - 1:stmt.end_lineno]
            if in_function and not any("#" in line for line in span):
                rel = path.relative_to(SOURCE.parent)
                unexplained.append(f"{rel}:{stmt.lineno}: {span[0].strip()}")
    return edges, unexplained


# -- the rules -----------------------------------------------------------------------------------
def stage_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in STAGES):
        return "top"
    return parts[1]


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def backward_edges(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """Imports from a stage into a later one, or of a module in no stage."""
    rank = {s: i for i, s in enumerate(STAGES)}
    out = []
    for src, dsts in sorted(edges.items()):
        for dst in sorted(dsts):
            a, b = stage_of(src), stage_of(dst)
            if a not in rank or b not in rank:
                out.append(f"{src} -> {dst}: no stage")
            elif rank[b] > rank[a]:
                out.append(f"{src} ({a}) -> {dst} ({b})")
    return out


def runtime_violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """Policy modules ``runtime`` reaches, directly or not (see the module docstring)."""
    out = []
    for start in sorted(m for m in edges if stage_of(m) == "runtime"):
        seen, todo = {start}, [start]
        while todo:
            for dst in edges.get(todo.pop(), ()):
                if dst in seen:
                    continue
                seen.add(dst)
                if stage_of(dst) in RUNTIME_NEVER and dst not in RUNTIME_DATA:
                    out.append(f"{start} reaches {dst}")
                else:
                    todo.append(dst)
    return out


# -- the tests -----------------------------------------------------------------------------------
FILES = modules()
EDGES, UNEXPLAINED = import_graph(FILES)


def test_every_module_is_in_a_stage():
    assert [m for m in FILES if stage_of(m) not in STAGES] == []


def test_no_import_cycles():
    assert cycles(EDGES) == []


def test_no_import_from_a_later_stage():
    assert backward_edges(EDGES) == []


def test_ir_imports_nothing_of_autopar_outside_ir():
    assert [(m, d) for m, ds in EDGES.items() if stage_of(m) == "ir"
            for d in ds if stage_of(d) != "ir"] == []


def test_runtime_reaches_no_policy():
    assert runtime_violations(EDGES) == []
    # the data it obeys: plan steps and timelines, which import nothing of placement
    assert {d for m, ds in EDGES.items() if stage_of(m) == "runtime" for d in ds
            if stage_of(d) == "schedule"} <= RUNTIME_DATA


def test_every_in_function_import_says_why():
    assert UNEXPLAINED == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The rules fire on a made-up package: a cycle, a backward import, runtime reaching a
    policy, an in-function import without a reason, relative imports resolved."""
    files = {
        "__init__.py": "",
        "api.py": "from .ir import graph\n",
        "ir/__init__.py": "",
        "ir/graph.py": "from ..api import x\n",  # ir -> top: backward, and a cycle with api
        "runtime/__init__.py": "",
        "runtime/run.py": "from ..schedule.steps import Run\nfrom ..schedule import place\n",
        "schedule/__init__.py": "",
        "schedule/steps.py": "from typing import TYPE_CHECKING\n"
                             "if TYPE_CHECKING:\n    from .place import P\n",
        "schedule/place.py": "def f():\n    from ..passes import fuse\n"
                             "def g():\n    from ..ir import graph  # start-up cost\n",
        "passes/__init__.py": "",
        "passes/fuse.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges, unexplained = import_graph_at(modules(tmp_path), tmp_path)
    assert edges["autopar.ir.graph"] == {"autopar.api"}
    assert edges["autopar.api"] == {"autopar.ir.graph"}
    assert edges["autopar.schedule.steps"] == set()  # TYPE_CHECKING: never runs
    assert edges["autopar.schedule.place"] == {"autopar.passes.fuse", "autopar.ir.graph"}
    assert cycles(edges) == [["autopar.api", "autopar.ir.graph"]]
    assert "autopar.ir.graph (ir) -> autopar.api (top)" in backward_edges(edges)
    # schedule comes before passes: placement may not import a pass
    assert "autopar.schedule.place (schedule) -> autopar.passes.fuse (passes)" in \
        backward_edges(edges)
    assert runtime_violations(edges) == ["autopar.runtime.run reaches autopar.schedule.place"]
    assert [u.split(": ", 1)[1] for u in unexplained] == ["from ..passes import fuse"]
    assert stage_of("autopar.graph") == "top" and stage_of("autopar.ir.graph") == "ir"


def import_graph_at(files: Mapping[str, Path], root: Path) -> tuple[dict[str, set[str]],
                                                                    list[str]]:
    """:func:`import_graph` of a package laid out under ``root`` (for the self-check)."""
    global SOURCE
    saved, SOURCE = SOURCE, root
    try:
        return import_graph(files)
    finally:
        SOURCE = saved


def test_flat_layout_fails(tmp_path):
    """The flat layout this replaced (``autopar/capture.py`` importing ``api`` inside a function,
    ``fold`` taking capture's privates) breaks the rules."""
    for name, text in {
        "__init__.py": "",
        "api.py": "from .capture import make_backend\n",
        "capture.py": "def autopar_backend():\n    from .api import make_runner\n",
        "fold.py": "from .capture import _SIZE_OPS\n",
    }.items():
        (tmp_path / name).write_text(text)
    edges, unexplained = import_graph_at(modules(tmp_path), tmp_path)
    assert cycles(edges) == [["autopar.api", "autopar.capture"]]
    assert len(unexplained) == 1
