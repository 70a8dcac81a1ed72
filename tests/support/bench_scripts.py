"""Import a script of ``bench/`` in a test, as running it would: its folder first on ``sys.path`` while it loads
(the scripts import their siblings, e.g. ``perf_split``), and ``sys.path`` as it was afterwards, so no later test
finds ``bench/`` there by accident."""

from __future__ import annotations

import importlib
import pathlib
import sys
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def bench_script(name: str) -> ModuleType:
    """The module ``bench/<name>.py`` (imported once; its siblings stay in ``sys.modules``)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
