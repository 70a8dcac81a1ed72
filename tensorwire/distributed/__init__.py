"""``backend="tensorwire"``: tensorwire as a ``torch.distributed`` backend.

After ``import tensorwire``::

    dist.init_process_group("tensorwire")            # under torchrun, or with store=/rank=/world_size=
    dist.new_group(ranks, backend="tensorwire")      # under any default group

Point-to-point calls (``send``, ``recv``, ``isend``, ``irecv``,
``batch_isend_irecv``, ``torch.distributed.pipelining``) run on tensorwire
links; collectives go to an inner gloo (CPU) / NCCL (CUDA) group. See
``docs/distributed.md``.

Registration is cheap and does not import torch: ``import tensorwire`` calls
:func:`install`, which registers the backend at once when ``torch.distributed``
is already imported, and otherwise leaves a one-shot import hook that registers
it right after ``torch.distributed`` finishes importing (``import torch`` does
that). :func:`register` does it by hand (idempotent).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

__all__ = ["BACKEND_NAME", "register", "install", "is_registered"]

BACKEND_NAME = "tensorwire"
_lock = threading.Lock()
_registered = False


def _create(opts: Any, pg_options: Any = None) -> Any:
    """torch's extended creator API: ``opts`` has the store, group rank and size, timeout and group name."""
    from .process_group import create

    return create(opts.store, opts.group_rank, opts.group_size, opts.timeout, group_id=str(opts.group_id))


def register() -> bool:
    """Register backend ``"tensorwire"`` with ``torch.distributed`` (for CPU and CUDA). Idempotent.

    Returns:
        True when the backend is registered (now or before); False when this
        torch has no ``torch.distributed``.
    """
    global _registered
    with _lock:
        if _registered:
            return True
        import torch.distributed as dist

        if not dist.is_available():
            return False
        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True
        return True


def is_registered() -> bool:
    return _registered


class _Loader(importlib.abc.Loader):
    """Wraps torch.distributed's loader: runs it, then registers the backend."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            register()
        except Exception:
            import logging

            logging.getLogger(__name__).warning("could not register backend 'tensorwire'", exc_info=True)


class _Hook(importlib.abc.MetaPathFinder):
    """One-shot: the first import of ``torch.distributed`` gets a loader that registers the backend after it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch.distributed":
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_hook: _Hook | None = None


def _remove_hook() -> None:
    global _hook
    with _lock:
        if _hook is not None:
            try:
                sys.meta_path.remove(_hook)
            except ValueError:
                pass
            _hook = None


def install() -> None:
    """Make ``backend="tensorwire"`` available as soon as ``torch.distributed`` is (called by ``import tensorwire``)."""
    global _hook
    mod = sys.modules.get("torch.distributed")
    if mod is not None and hasattr(mod, "Backend"):
        register()
        return
    if mod is not None:  # being imported right now (e.g. tensorwire imported from inside torch's import)
        return
    with _lock:
        if _hook is None and not _registered:
            _hook = _Hook()
            sys.meta_path.insert(0, _hook)
