"""The import graph of ``tensorwire/`` keeps the layers of DESIGN's "Never" list.

Every module is parsed with :mod:`ast` (nothing is imported); absolute and relative
imports are resolved, at module level, under ``if TYPE_CHECKING:`` and inside
functions. Each rule is one test, and each failure names the file, the line and
the import, so a violation reads as a sentence.

Rules:

- the leaves (errors, spec, buffers, settings, cuda, lifecycle) import only leaves;
- ``transport/**`` imports only leaves and ``transport/**`` (so never p2p, serve or
  staging), and no module of the ``transport/ucx`` package imports ``transport/tcp``
  (shared socket code lives in ``transport/_socket.py``);
- ``serve/protocol`` imports neither the serve client nor the daemon; the client and
  the daemon import neither each other nor ``p2p``;
- only ``p2p/control.py``, ``serve/**`` and ``_proto.py`` (the spec <-> message
  conversion both use) import the generated stubs in ``tensorwire/v1``;
- no ``from x import _private`` across modules (a private *module* may be imported
  from inside the package that holds it);
- the runtime import graph has no cycle, and a function-local import of a tensorwire
  module needs a reason: the module it imports loads a third-party package at import
  time (then it is a lazy import of torch, grpc, ucxx, numpy... in disguise), or the
  importer is in :data:`LOCAL_IMPORT_ALLOWED` below.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tensorwire"

pytestmark = pytest.mark.timeout(60)

LEAVES = frozenset(
    {
        "tensorwire.errors",
        "tensorwire.spec",
        "tensorwire.buffers",
        "tensorwire.settings",
        "tensorwire.cuda",
        "tensorwire.lifecycle",
        "tensorwire.cpus",
    }
)
STUBS = "tensorwire.v1"
# Who may import the generated stubs, besides the stubs themselves.
STUB_USERS = ("tensorwire.p2p.control", "tensorwire.serve", "tensorwire._proto")

# Importers whose function-local imports of tensorwire modules are allowed, and why.
# Keep this short: everything else imports at module level or imports something heavy lazily.
LOCAL_IMPORT_ALLOWED = {
    "tensorwire.cli": "the CLI: `tensorwire --help` must not load what the subcommands need",
    "tensorwire.serve.cli": "the serve CLI: parsing flags must not load the daemon or the client",
    "tensorwire.doctor": "a top-level tool: each check loads only what it checks",
    "tensorwire.demo": "a top-level tool: the spawned workers load tensorwire, the parent need not",
    "tensorwire.benchmark": "a top-level tool: each backend loads only its own stack",
}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    target: str  # the tensorwire (or third-party) module imported
    names: tuple[str, ...]  # names taken from it with `from target import ...` (empty for `import`)
    line: int
    local: bool  # inside a function
    type_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        path = self.importer.replace(".", "/")
        if (ROOT / f"{path}/__init__.py").exists():
            path += "/__init__"
        return f"{path}.py:{self.line}"

    def __str__(self) -> str:
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else f"import {self.target}"
        kind = "function-local " if self.local else "TYPE_CHECKING " if self.type_only else ""
        return f"{self.where()}: {kind}{what}"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES.get(name, pathlib.Path()).name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, *, local: bool, type_only: bool) -> Iterator[tuple[ast.AST, bool, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, local, type_only
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(child, local=True, type_only=type_only)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local=local, type_only=True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), local=local, type_only=type_only)
        else:
            yield from _walk(child, local=local, type_only=type_only)


def imports_of(name: str, source: str | None = None) -> list[Import]:
    path = MODULES[name]
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = name if is_package(name) else name.rpartition(".")[0]
    out = []
    for node, local, type_only in _walk(tree, local=False, type_only=False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Import(name, alias.name, (), node.lineno, local, type_only))
            continue
        assert isinstance(node, ast.ImportFrom)
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            base_name = ".".join(base + ([node.module] if node.module else []))
        else:
            base_name = node.module or ""
        if base_name == "__future__":
            continue
        # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
        plain = []
        for alias in node.names:
            sub = f"{base_name}.{alias.name}"
            if sub in MODULES:
                out.append(Import(name, sub, (), node.lineno, local, type_only))
            else:
                plain.append(alias.name)
        if plain:
            out.append(Import(name, base_name, tuple(plain), node.lineno, local, type_only))
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def internal(imp: Import) -> bool:
    return imp.target == "tensorwire" or imp.target.startswith("tensorwire.")


def under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def all_imports(*, runtime: bool = False) -> Iterator[Import]:
    for name, imps in GRAPH.items():
        if under(name, STUBS):
            continue  # generated code
        for imp in imps:
            if internal(imp) and not (runtime and imp.type_only):
                yield imp


def report(violations: list[Import | str], rule: str) -> None:
    assert not violations, f"{rule}:\n" + "\n".join(f"  {v}" for v in violations)


# -- the rules ------------------------------------------------------------------------


def test_leaves_import_only_leaves():
    bad = [imp for imp in all_imports() if imp.importer in LEAVES and imp.target not in LEAVES]
    report(bad, "a leaf (errors, spec, buffers, settings, cuda, lifecycle, cpus) imports a module that is not a leaf")


def test_transport_imports_only_leaves_and_transport():
    bad = [
        imp
        for imp in all_imports()
        if under(imp.importer, "tensorwire.transport")
        and not (imp.target in LEAVES or under(imp.target, "tensorwire.transport"))
    ]
    report(bad, "transport/** imports something above it (p2p, serve, staging, ...)")


def test_ucx_does_not_import_tcp():
    bad = [
        imp
        for imp in all_imports()
        if under(imp.importer, "tensorwire.transport.ucx") and under(imp.target, "tensorwire.transport.tcp")
    ]
    report(bad, "transport/ucx imports transport/tcp (shared socket code belongs in transport/_socket.py)")


def test_serve_protocol_imports_neither_client_nor_daemon():
    bad = [
        imp
        for imp in all_imports()
        if under(imp.importer, "tensorwire.serve.protocol")
        and under(
            imp.target, "tensorwire.serve.client", "tensorwire.serve.daemon", "tensorwire.serve.cli", "tensorwire.p2p"
        )
    ]
    report(bad, "serve/protocol imports the client, the daemon or p2p")


def test_serve_client_and_daemon_import_neither_each_other_nor_p2p():
    bad = []
    for imp in all_imports():
        if under(imp.importer, "tensorwire.serve.client"):
            forbidden = ("tensorwire.serve.daemon", "tensorwire.serve.cli", "tensorwire.p2p")
        elif under(imp.importer, "tensorwire.serve.daemon"):
            forbidden = ("tensorwire.serve.client", "tensorwire.serve.cli", "tensorwire.p2p")
        else:
            continue
        if under(imp.target, *forbidden):
            bad.append(imp)
    report(bad, "the serve client and daemon import each other or p2p")


def test_only_control_and_serve_import_the_generated_stubs():
    bad = [imp for imp in all_imports() if under(imp.target, STUBS) and not under(imp.importer, *STUB_USERS)]
    report(bad, f"generated stubs imported outside {', '.join(STUB_USERS)}")


def test_no_private_name_is_imported_across_modules():
    bad = []
    for imp in all_imports():
        if imp.target != imp.importer and any(n.startswith("_") and not n.startswith("__") for n in imp.names):
            bad.append(imp)
        # A private module (pkg._mod) may be imported from inside pkg only.
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                if not under(imp.importer, ".".join(parts[:i])):
                    bad.append(imp)
                break
    report(bad, "a private name (or private module) is imported from another module")


def _module_level_closure(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for imp in GRAPH.get(mod, ()):
            if imp.local or imp.type_only:
                continue
            todo.append(imp.target)
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            parts = imp.target.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))
    return seen


def loads_third_party(name: str) -> bool:
    """Whether importing ``name`` imports a package outside the standard library and tensorwire."""
    for mod in _module_level_closure(name):
        top = mod.split(".")[0]
        if top != "tensorwire" and top not in sys.stdlib_module_names:
            return True
    return False


def test_the_runtime_import_graph_has_no_cycle():
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], Import] = {}
    for imp in all_imports(runtime=True):
        if imp.target != imp.importer and imp.target in MODULES:
            edges.setdefault(imp.importer, set()).add(imp.target)
            lines.setdefault((imp.importer, imp.target), imp)
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt) :] + [nxt]
                cycles.append(" -> ".join(str(lines[(a, b)]) for a, b in zip(loop, loop[1:])))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    report(cycles, "import cycle (a function-local import that dodges a cycle is still a cycle)")


def test_function_local_imports_of_tensorwire_modules_have_a_reason():
    bad = [
        imp
        for imp in all_imports(runtime=True)
        if imp.local
        and not under(imp.importer, *LOCAL_IMPORT_ALLOWED)
        and imp.target in MODULES
        and not loads_third_party(imp.target)
    ]
    report(
        bad,
        "function-local import of a tensorwire module that loads nothing heavy "
        "(import it at module level, or add the importer to LOCAL_IMPORT_ALLOWED with a reason)",
    )


# -- the checker checks ---------------------------------------------------------------


def test_the_graph_resolves_absolute_relative_local_and_type_checking_imports(monkeypatch):
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import base\n"
        "from ..errors import ConfigError, _private\n"
        "import tensorwire.spec\n"
        "if TYPE_CHECKING:\n"
        "    from tensorwire.p2p import link\n"
        "def f():\n"
        "    from .. import cuda\n"
    )
    monkeypatch.setitem(MODULES, "tensorwire.transport.fake_for_test", PACKAGE / "transport" / "fake_for_test.py")
    got = {(i.target, i.names, i.local, i.type_only) for i in imports_of("tensorwire.transport.fake_for_test", src)}
    assert got == {
        ("typing", ("TYPE_CHECKING",), False, False),
        ("tensorwire.transport.base", (), False, False),
        ("tensorwire.errors", ("ConfigError", "_private"), False, False),
        ("tensorwire.spec", (), False, False),
        ("tensorwire.p2p.link", (), False, True),
        ("tensorwire.cuda", (), True, False),
    }


def test_the_rules_fail_on_a_violation(monkeypatch):
    """Each rule, fed one bad edge, fails (so a green run means the graph is clean)."""
    planted = {
        test_leaves_import_only_leaves: Import("tensorwire.spec", "tensorwire.transport.base", (), 1, False, False),
        test_transport_imports_only_leaves_and_transport: Import(
            "tensorwire.transport.tcp", "tensorwire.p2p.staging", (), 1, False, False
        ),
        test_ucx_does_not_import_tcp: Import(
            "tensorwire.transport.ucx.listener", "tensorwire.transport.tcp", ("dial",), 1, False, False
        ),
        test_serve_protocol_imports_neither_client_nor_daemon: Import(
            "tensorwire.serve.protocol.wire", "tensorwire.serve.daemon.config", (), 1, False, False
        ),
        test_serve_client_and_daemon_import_neither_each_other_nor_p2p: Import(
            "tensorwire.serve.client.client", "tensorwire.serve.daemon.config", ("TLSConfig",), 1, False, True
        ),
        test_only_control_and_serve_import_the_generated_stubs: Import(
            "tensorwire.p2p.node", "tensorwire.v1", ("control_pb2",), 1, True, False
        ),
        test_no_private_name_is_imported_across_modules: Import(
            "tensorwire.p2p.link", "tensorwire.cuda", ("_memcpy_async",), 1, False, False
        ),
        test_the_runtime_import_graph_has_no_cycle: Import(
            "tensorwire.errors", "tensorwire.p2p.node", (), 1, True, False
        ),
        test_function_local_imports_of_tensorwire_modules_have_a_reason: Import(
            "tensorwire.p2p.node", "tensorwire.errors", ("ConfigError",), 1, True, False
        ),
    }
    for rule, imp in planted.items():
        monkeypatch.setitem(GRAPH, imp.importer, [*GRAPH[imp.importer], imp])
        with pytest.raises(AssertionError, match=imp.importer.replace("tensorwire.", "").replace(".", "/")):
            rule()
        monkeypatch.setitem(GRAPH, imp.importer, [i for i in GRAPH[imp.importer] if i is not imp])
