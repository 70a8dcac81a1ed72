"""Hooks for the whole suite: which hot path it runs against (see :mod:`tensorwire.native`)."""

from __future__ import annotations

import pytest

from tensorwire import native


def pytest_report_header(config: pytest.Config) -> str:
    return f"tensorwire hot path: {native.summary()} (tensorwire.native)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``pure_python`` replace a method of a class, which compiled code calls directly: they run
    against the pure-Python modules only (the same source, so what they check holds for both)."""
    if "compiled" not in native.status().values():
        return
    skip = pytest.mark.skip(reason="patches a method of a class that is compiled here (tensorwire.native)")
    for item in items:
        if item.get_closest_marker("pure_python"):
            item.add_marker(skip)
