"""Hooks for the whole suite: which hot path it runs against (see :mod:`tensorwire.native`)."""

from __future__ import annotations

import pytest

from tensorwire import native


def pytest_report_header(config: pytest.Config) -> str:
    kinds = list(native.status().values())
    n = kinds.count("compiled")
    return f"tensorwire hot path: {'compiled' if n else 'pure Python'} ({n}/{len(kinds)} modules compiled by mypyc)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``pure_python`` replace a method of a class, which compiled code calls directly: they run
    against the pure-Python modules only (the same source, so what they check holds for both)."""
    if "compiled" not in native.status().values():
        return
    skip = pytest.mark.skip(reason="patches a method of a class that is compiled here (tensorwire.native)")
    for item in items:
        if item.get_closest_marker("pure_python"):
            item.add_marker(skip)
