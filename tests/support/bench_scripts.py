"""Scripts of ``bench/`` in tests: imported as running them would (:func:`bench_script`: their folder first on
``sys.path`` while one loads -- the scripts import their siblings, e.g. ``perf_split`` -- and ``sys.path`` as it
was afterwards, so no later test finds ``bench/`` there by accident), or run as a user would (:func:`run_bench`)."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
ROOT = str(BENCH.parent)


def bench_script(name: str) -> ModuleType:
    """The module ``bench/<name>.py`` (imported once; its siblings stay in ``sys.modules``)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


def run_bench(
    script: str, *args: str, timeout: float, checkout_first: bool = True, keep_transport: bool = False
) -> subprocess.CompletedProcess:
    """Run ``bench/<script>`` with ``args`` from the checkout's root; its output captured as text.

    ``checkout_first``: the checkout ahead of any installed tensorwire on ``PYTHONPATH`` (off for scripts that
    pick the source tree themselves); ``keep_transport``: leave a ``TENSORWIRE_TRANSPORT`` of the test run set.
    """
    env = bench_env(checkout_first=checkout_first, keep_transport=keep_transport)
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def bench_env(*, checkout_first: bool = True, keep_transport: bool = False) -> dict[str, str]:
    """The environment a bench script runs in (:func:`run_bench`'s, also for one started another way, e.g. by
    torchrun): the checkout first on ``PYTHONPATH`` unless told otherwise, no ``TENSORWIRE_TRANSPORT`` of the test
    run unless kept."""
    env = dict(os.environ)
    if checkout_first:
        env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    if not keep_transport:
        env.pop("TENSORWIRE_TRANSPORT", None)
    return env
