"""Setting up the copy-engine path between two processes, and the watchdog that looks after its pairs.

:func:`capable` says whether this process can take the path; :func:`exchange_region`
makes (lower rank) or maps (higher rank) a pair's shared region, the name going
over a store both already share (the group's store, or the node's bootstrap
store), and both agree on the outcome: the higher rank answers on the store
whether it mapped it, so either both use the path or neither does.
:class:`Watchdog` looks at every pair a few times a second (:meth:`CePair.check`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from ...errors import TensorWireError
from ...settings import setting
from ..select import host_id
from .driver import CeDriver
from .pair import CePair
from .region import Region

__all__ = ["capable", "exchange_region", "Watchdog", "WATCH_S"]

log = logging.getLogger(__name__)

#: how often the watchdog looks at its pairs
WATCH_S = 0.05
_NO = "-"


def capable() -> str | None:
    """Why this process cannot take the copy-engine path (None: it can). Creates no CUDA context."""
    if setting("cuda_path") == "ucx":
        return "TENSORWIRE_CUDA_PATH=ucx"
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm for the pair's shared region"
    if not host_id():
        return "this host's identity is unknown (no boot id, machine id or IPC namespace)"
    try:
        CeDriver.get()
    except TensorWireError as exc:
        return str(exc)
    return None


def _get(store: Any, key: str, timeout: float) -> str:
    store.wait([key], timedelta(seconds=max(0.1, timeout)))
    return bytes(store.get(key)).decode()


def exchange_region(store: Any, key: str, *, lower: bool, why_not: str | None, timeout: float) -> Region | None:
    """Make (``lower``) or map the pair's region; None where either side cannot (both sides agree).

    ``why_not``: this side's reason not to take the path (None: it can). Both sides call it with the same
    ``key``; the lower rank publishes the region's name (or that it will not), the higher one maps it and
    answers.

    Raises:
        TensorWireError: TENSORWIRE_CUDA_PATH=ce and the path cannot be set up.
    """
    required = setting("cuda_path") == "ce"
    region: Region | None = None
    answer = ""
    try:
        if lower:
            if why_not is not None:
                store.set(key, _NO)
                answer = why_not
            else:
                region = Region.create()
                store.set(key, region.path)
                answer = _get(store, key + "/ok", timeout)
                if answer != "1":
                    region.close()
                    region = None
        else:
            path = _get(store, key, timeout)
            if path == _NO:
                answer = "the peer cannot take it"
            elif why_not is not None:
                store.set(key + "/ok", why_not)
                answer = why_not
            else:
                try:
                    region = Region.attach(path)
                except (OSError, TensorWireError) as exc:
                    answer = f"{type(exc).__name__}: {exc}"
                    store.set(key + "/ok", answer)
                    raise
                store.set(key + "/ok", "1")
    except (OSError, TensorWireError, RuntimeError) as exc:  # (torch's store raises RuntimeError subclasses)
        if region is not None:
            region.close()
        region = None
        answer = answer or str(exc)
    if region is None and required:
        raise TensorWireError(f"TENSORWIRE_CUDA_PATH=ce, but the copy-engine path cannot be set up: {answer}")
    return region


class Watchdog:
    """One thread: looks at its pairs every ``WATCH_S`` s; a pair that fails is reported to ``on_failure``."""

    def __init__(self, name: str, on_failure: Callable[[CePair, BaseException], None] | None = None) -> None:
        self.pairs: list[CePair] = []
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._name = name

    def add(self, pair: CePair) -> None:
        with self._lock:
            self.pairs = [*self.pairs, pair]
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def remove(self, pair: CePair) -> None:
        with self._lock:
            self.pairs = [p for p in self.pairs if p is not pair]

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            now = time.monotonic()
            for pair in self.pairs:
                if pair.error is not None:
                    continue
                try:
                    lost = pair.check(now)
                except Exception as exc:  # noqa: BLE001 - a broken region fails its pair
                    lost = exc
                    pair.fail(exc)
                if lost is not None:
                    log.error("tensorwire: rank %d <-> rank %d (copy engine): %s", pair.rank, pair.peer, lost)
                    if self._on_failure is not None:
                        self._on_failure(pair, lost)

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
