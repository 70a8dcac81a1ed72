"""This process's CUDA IPC exports and imports (:class:`Exports`), shared by every pair of a process."""

from __future__ import annotations

import threading
from typing import Any

from .driver import NotExportable

__all__ = ["Exports"]


class Exports:
    """This process's exports (allocation -> IPC handle) and imports (peer's handle -> mapped address).

    An export is cached by the allocation's buffer id (unique per allocation for the life of the process, so a
    freed and re-made allocation at the same address is exported anew); an import by the handle's bytes.
    """

    def __init__(self, driver: Any) -> None:
        self.driver = driver
        self._exports: dict[int, tuple[bytes, int] | None] = {}
        self._imports: dict[tuple[int, bytes], int] = {}
        self._lock = threading.Lock()

    def export(self, ptr: int) -> tuple[bytes, int] | None:
        """``(handle, offset of ptr in the allocation)``, or None where legacy IPC cannot export it."""
        base, _size, buf_id = self.driver.allocation(ptr)
        if buf_id in self._exports:
            hit = self._exports[buf_id]
        else:
            try:
                hit = (self.driver.export(base), base)
            except NotExportable:
                hit = None
            self._exports[buf_id] = hit
        if hit is None:
            return None
        return hit[0], ptr - hit[1]

    def open(self, device: int, handle: bytes) -> int:
        key = (device, handle)
        addr = self._imports.get(key)
        if addr is None:
            with self._lock:
                addr = self._imports.get(key)
                if addr is None:
                    addr = self._imports[key] = self.driver.open(handle)
        return addr

    def close_all(self) -> None:
        with self._lock:
            imports, self._imports = self._imports, {}
        for addr in imports.values():
            try:
                self.driver.close(addr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
