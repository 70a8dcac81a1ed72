"""The house's size bounds (``docs/architecture.md``, "Sizes"): a hand-written module of ``tensorwire/`` has at
most 600 lines, a class at most 400. The generated stubs in ``tensorwire/v1`` are not hand-written. Parsed with
:mod:`ast`; nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tensorwire"
MAX_MODULE = 600
MAX_CLASS = 400
GENERATED = PACKAGE / "v1"


def oversized(paths: "list[pathlib.Path]") -> list[str]:
    """One line per module or class past its bound, naming the file and its size."""
    out = []
    for path in paths:
        src = path.read_text(encoding="utf-8")
        n = len(src.splitlines())
        if n > MAX_MODULE:
            out.append(f"{path}: {n} lines (a module has at most {MAX_MODULE})")
        for node in ast.walk(ast.parse(src, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS:
                    out.append(f"{path}:{node.lineno}: class {node.name} is {size} lines (at most {MAX_CLASS})")
    return out


def test_every_hand_written_module_and_class_is_within_the_bounds():
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if GENERATED not in p.parents]
    assert len(paths) > 100  # the walk found the package
    assert oversized(paths) == []


def test_the_bounds_fail_on_a_module_or_class_too_large(tmp_path):
    ok = tmp_path / "ok.py"
    ok.write_text("class A:\n" + "    x = 1\n" * (MAX_CLASS - 1) + "\n" * (MAX_MODULE - MAX_CLASS))
    assert oversized([ok]) == []
    big_class = tmp_path / "big_class.py"
    big_class.write_text("class A:\n" + "    x = 1\n" * MAX_CLASS)
    big_module = tmp_path / "big_module.py"
    big_module.write_text("x = 1\n" * (MAX_MODULE + 1))
    found = oversized([big_class, big_module])
    assert len(found) == 2
    assert "class A is 401 lines" in found[0]
    assert "601 lines (a module has at most 600)" in found[1]
