"""The package's import graph: no import cycle, no module importing another's private name.

An AST walk of jcp/ (nothing is imported): every `import jcp.x` / `from jcp.x import y`
in module m, at any depth (lazy imports inside functions count too), is an edge m -> x of
the graph of jcp modules (`from jcp import model` names the module jcp.model; a package is
its __init__.py).
"""

from __future__ import annotations

import ast
import functools
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jcp")


@functools.cache
def _tree(path: str) -> ast.Module:
    """The parsed file, once per module of tests: 17 import walks of jcp's ~100 files
    re-parsed them each time (~14 of this module's 19 CPU s)."""
    with open(path) as f:
        return ast.parse(f.read(), path)


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py under jcp/."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))
                name = rel[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def _resolve(name: str, modules) -> str | None:
    """The jcp module a dotted import names (a name inside a module resolves to it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules) -> dict[str, list[tuple[str, str | None, int]]]:
    """module -> [(imported module, imported name or None, line)] over jcp modules."""
    out = {}
    for mod, path in modules.items():
        tree = _tree(path)
        is_pkg = path.endswith("__init__.py")
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("jcp"):
                        edges.append((_resolve(a.name, modules), None, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    src = base + ("." + node.module if node.module else "")
                else:
                    src = node.module or ""
                if not src.startswith("jcp"):
                    continue
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in modules:  # `from jcp import model`: the module itself
                        edges.append((sub, None, node.lineno))
                    else:
                        edges.append((_resolve(src, modules), a.name, node.lineno))
        out[mod] = [e for e in edges if e[0] is not None]
    return out


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def graph_of(edges) -> dict[str, set[str]]:
    """module -> the jcp modules it imports (itself left out)."""
    return {m: {t for t, _, _ in es if t != m} for m, es in edges.items()}


def test_the_walk_sees_the_package():
    """The walk finds the modules and edges it must (so the checks below can fail)."""
    modules = _modules()
    assert {
        "jcp",
        "jcp.trainer",
        "jcp.attention",
        "jcp.attention.blockwise",
        "jcp.model",
        "jcp.model.params",
        "jcp.config",
        "jcp.server.app",
    } <= set(modules)
    edges = imports(modules)
    assert ("jcp.config", "QwenConfig") in {(t, n) for t, n, _ in edges["jcp.hf"]}
    assert "jcp.model.params" in graph_of(edges)["jcp.hf"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(graph_of(imports(_modules())))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cross_module_private_import():
    bad = [
        f"{m}:{line} imports {t}.{n}"
        for m, es in imports(_modules()).items()
        for t, n, line in es
        if n is not None and n.startswith("_") and not n.startswith("__") and t != m
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "module",
    [
        "jcp.server.app",
        "jcp.server.state",
        "jcp.server.wire",
        "jcp.server.scheduler",
        "jcp.server.openai_api",
        "jcp.server.openai_params",
        "jcp.server.openai_format",
        "jcp.server.text",
        "jcp.server.checkpoint_api",
        "jcp.server.asgi",
        "jcp.server.context",
        "jcp.server.future_table",
        "jcp.server.routes.service",
        "jcp.server.routes.training",
        "jcp.server.routes.sampling",
        "jcp.server.routes.runs",
        "jcp.server.routes.futures",
    ],
)
def test_server_http_side_never_imports_jax(module):
    """The HTTP side of the server imports no jax, directly or through jcp modules."""
    modules = _modules()
    graph = imports(modules)
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        for node in ast.walk(_tree(modules[m])):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            assert not any(n == "jax" or n.startswith("jax.") for n in names), (m, names)
        todo += [t for t, _, _ in graph[m]]


TESTS = os.path.dirname(os.path.abspath(__file__))


def private_members() -> frozenset[str]:
    """The private members jcp's classes define: methods `def _x` and attributes set as
    `self._x` (dunders aside)."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ClassDef):
                names |= {
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
            ):
                names.add(node.attr)
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


def private_reach_of_tests(root: str = TESTS, members: frozenset[str] = frozenset()) -> list[str]:
    """Where a test module (tests/, helpers included) reaches a jcp private name: imports
    `_x` from a jcp module, reads `m._x` of a name bound to a jcp module or object it
    imported (`from jcp import lora as L` … `L._x`, `jcp._x`), or reads or patches (by
    name, `setattr(obj, "_x", …)`) a private member of a jcp object (`members`, read off
    anything but `self`)."""
    bad = []
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            with open(path) as fh:
                tree = ast.parse(fh.read(), path)
            jcp_names = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    jcp_names |= {
                        (a.asname or a.name).split(".")[0]
                        for a in node.names
                        if a.name.split(".")[0] == "jcp"
                    }
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jcp"):
                    for a in node.names:
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            bad.append(
                                f"{os.path.relpath(path, root)}:{node.lineno} imports "
                                f"{node.module}.{a.name}"
                            )
                        jcp_names.add(a.asname or a.name)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                ):
                    base = node.value
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                    if (
                        isinstance(base, ast.Name)
                        and base.id in jcp_names
                        or (node.attr in members and not own)
                    ):
                        bad.append(
                            f"{os.path.relpath(path, root)}:{node.lineno} reads {ast.unparse(node)}"
                        )
                elif (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and node.value in members
                    and path != os.path.abspath(__file__)  # this checker names them as data
                ):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno} names {node.value}")
    return bad


def test_tests_reach_jcp_through_public_names_only(tmp_path):
    """Tests use what a user can: no jcp private name, imported or read off a module (the
    walk first shown to find each kind in a file made for it)."""
    (tmp_path / "test_x.py").write_text(
        "import jcp\nfrom jcp import lora as L\nfrom jcp.mesh import _hidden, put\n"
        "L._route(1)\njcp.trainer._f\nput._y\nself._ok\nw._mine\nself._mine\n"
        "setattr(w, '_mine', 1)\nw._theirs\n"
    )
    got = private_reach_of_tests(str(tmp_path), frozenset({"_mine"}))
    assert sorted(b.split(" ", 1)[1] for b in got) == [
        "imports jcp.mesh._hidden",
        "names _mine",
        "reads L._route",
        "reads jcp.trainer._f",
        "reads put._y",
        "reads w._mine",
    ]
    members = private_members()
    assert {"_complete", "_prepare"} <= members  # Worker's and Trainer's
    bad = private_reach_of_tests(members=members)
    assert not bad, "\n".join(bad)
