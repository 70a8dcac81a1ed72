"""The compiled hot path: which modules are built to C by mypyc at install time, and whether they were.

The per-message path of tensorwire (framing, credits, the reader, the
``torch.distributed`` channel) is plain, type-checked Python. ``pip install``
compiles the modules in :data:`MODULES` with mypyc from that same source when
it can (a C compiler and Python's headers are there), and falls back to the
pure-Python modules when it cannot: behaviour is the same either way, only the
Python interpreter's cost per message goes (``bench/results/`` has the figures).

``TENSORWIRE_NATIVE`` at install time (read by ``setup.py``, not at run time):

- unset or ``auto``: compile when possible; an editable install (``pip install -e``)
  never compiles, so an edited module is never shadowed by a stale compiled one;
- ``1``: compile, and fail the install if that is not possible (also for ``-e``);
- ``0``: never compile.

Python imports a compiled module (``*.so``) in preference to the ``.py`` beside
it. :func:`status` says which kind each module of :data:`MODULES` is (it looks up
where each one's file is; their packages are imported for that); ``tensorwire
doctor`` prints it.

This module is a leaf: ``setup.py`` reads :data:`MODULES` from its source without
importing the package (keep it a literal tuple).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util

__all__ = ["MODULES", "status", "compiled", "summary"]

#: The modules compiled by mypyc, in dotted form. Each must pass the test suite compiled
#: (``make native-test``): no class attribute that is changed at run time unless it is a
#: ``ClassVar``, no ``continue`` inside ``try/finally`` or ``with`` (mypyc cannot compile it), no
#: weak reference to an instance (compiled classes have none: UCX's engine and connections keep
#: weak references to theirs, so they stay Python), no base class with a metaclass (the
#: ``torch.distributed`` Work classes), no method an instance replaces (a compiled caller calls the
#: class's own). The TCP transport is where a message's Python went: a first try that also compiled the
#: backend's channel modules (``distributed/{channel,signatures,messages}``) gave no further gain at 4 KiB
#: (``bench/results/native_cpu2_2026-11-27.md``); nor did serve's request framing (``serve/protocol/wire.py``) on a
#: 16-core host (``bench/results/native-serve-wire-ab_h200_2026-12-02.md``).
MODULES = (
    # TCP: framing, credits, the reader role, the send side
    "tensorwire.transport.tcp.wire",
    "tensorwire.transport.tcp.connection",
    "tensorwire.transport.tcp.credits",
    "tensorwire.transport.tcp.frames",
    "tensorwire.transport.tcp.reader",
    "tensorwire.transport.tcp.transport",
    # the copy-engine pair (CUDA within a host): its protocol's Python was most of a CUDA message's host time
    # (bench/results/ce-native-ab_h200x2_2026-11-30.md); the backend's CeWork (a torch Work) stays Python
    "tensorwire.transport.ce.driver",
    "tensorwire.transport.ce.region",
    "tensorwire.transport.ce.exports",
    "tensorwire.transport.ce.watched",
    "tensorwire.transport.ce.closing",
    "tensorwire.transport.ce.graphs",
    "tensorwire.transport.ce.waits",
    "tensorwire.transport.ce.pair",
)


def status() -> dict[str, str]:
    """``{module: "compiled" | "python" | "missing"}`` for each module of :data:`MODULES`."""
    out: dict[str, str] = {}
    for name in MODULES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:
            out[name] = "missing"
        elif spec.origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            out[name] = "compiled"
        else:
            out[name] = "python"
    return out


def compiled() -> bool:
    """Whether every module of :data:`MODULES` is the compiled one."""
    return all(kind == "compiled" for kind in status().values())


def summary() -> str:
    """One line for reports: ``compiled (n/n modules)``, ``partly compiled (k/n modules)`` or ``pure Python``."""
    kinds = list(status().values())
    n = kinds.count("compiled")
    if not n:
        return "pure Python"
    return f"{'compiled' if n == len(kinds) else 'partly compiled'} ({n}/{len(kinds)} modules)"
