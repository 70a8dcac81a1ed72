"""A table's shards side by side in this process's address space, for one gather over all of them.

A sharded client on the daemons' host reads a table's rows out of each
daemon's shared-memory slot. Gathering each daemon's rows on its own and then
putting them in the caller's order costs a second pass over the result (and a
scratch tensor): numpy and torch have no gather that reads several sources and
writes scattered rows in one pass (measured on the 2-core VM, 4,096 rows of
512 bytes from 3 shards of a 1,000,000-row table: 3 ``take`` + a permutation
0.17 ms, ``out[pos] = shard[rows]`` per shard 0.46 ms, one ``take`` over the
whole table 0.09 ms).

:class:`RowWindow` makes it one pass: it reserves one range of virtual memory
and maps each shard's slot (the region file the daemon named) into its own
part of that range with ``MAP_FIXED``, read-only, so that the shards' rows lie
on one grid of ``row_bytes``-wide rows. Row ``r`` of shard ``k`` is then row
``first[k] + r`` of :attr:`RowWindow.array`, and a gather of rows from every
shard is one ``take`` from it, straight into the caller's tensor. Each part
starts at a multiple of ``lcm(2 MiB, row_bytes)`` (the page -- a huge
page where the rows allow -- for the mapping, the row for the grid); the gaps between parts stay reserved
(``PROT_NONE``): a wrong index would fault rather than read another mapping.

Linux, 64-bit only (``mmap`` through ctypes: Python's ``mmap`` module cannot
map at an address); elsewhere :func:`supported` is False and the client gathers
per daemon. A window holds its mappings until it is rebound or closed, so a
slot the daemon freed is returned to the system only then: the sharded client
rebinds a part whenever its daemon names another slot and closes the window of
a table it forgets.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import stat
import sys
import threading
from typing import Any, Sequence

from tensorwire.serve.protocol.shm import SHM_DIR, ShmError, valid_name
from tensorwire.spec import TensorSpec

__all__ = ["RowWindow", "ShardView", "supported"]

_PAGE = mmap.PAGESIZE
#: Parts start at multiples of this too where the rows allow (a tmpfs with huge pages maps 2 MiB at a time).
_HUGE = 2 << 20
#: ... unless that makes the grid coarser than this (rows of an odd width: then pages only).
_MAX_GRID = 1 << 30
_PROT_NONE = 0
_PROT_READ = mmap.PROT_READ
_MAP_FIXED = 0x10  # the same on every Linux architecture tensorwire runs on (x86-64, arm64, ppc64le)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MAP_FAILED = (1 << 64) - 1

_libc: Any = None
_libc_lock = threading.Lock()


def supported() -> bool:
    """Whether windows can be made here (64-bit Linux with a C library ctypes can load)."""
    return _load() is not None


def _load() -> Any:
    global _libc
    if _libc is not None:
        return _libc or None
    with _libc_lock:
        if _libc is None:
            lib: Any = False
            if sys.platform.startswith("linux") and ctypes.sizeof(ctypes.c_void_p) == 8:
                try:
                    c = ctypes.CDLL(None, use_errno=True)
                    c.mmap.restype = ctypes.c_void_p
                    c.mmap.argtypes = [
                        ctypes.c_void_p,
                        ctypes.c_size_t,
                        ctypes.c_int,
                        ctypes.c_int,
                        ctypes.c_int,
                        ctypes.c_int64,
                    ]
                    c.munmap.restype = ctypes.c_int
                    c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                    lib = c
                except (OSError, AttributeError):  # pragma: no cover - no C library to load
                    lib = False
            _libc = lib
    return _libc or None


def _check(addr: Any, what: str) -> int:
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise ShmError(err, f"{what}: {os.strerror(err)}")
    return int(addr)


class ShardView:
    """Where one shard's current version lies in a daemon's shared memory, as its client was told.

    ``cells``/``cell``/``gen``: the client's read lease on it (the version is
    the same while ``cells[cell] == gen``); None: the daemon pinned it for a
    request of this client, which holds it until the client's next request.
    """

    __slots__ = ("region", "offset", "nbytes", "spec", "cells", "cell", "gen")

    def __init__(
        self, region: str, offset: int, nbytes: int, spec: TensorSpec, cells: Any = None, cell: int = 0, gen: int = 0
    ) -> None:
        self.region = region
        self.offset = offset
        self.nbytes = nbytes
        self.spec = spec
        self.cells = cells
        self.cell = cell
        self.gen = gen

    def valid(self) -> bool:
        """Whether the version is still the one this view names (always, for a pinned one)."""
        return self.cells is None or int(self.cells[self.cell]) == self.gen


class _Raw:
    """What ``numpy.asarray`` needs to view ``shape`` bytes at ``addr``.

    numpy is told the bytes are writable: the copier may gather through torch, whose ``from_numpy``
    warns about read-only arrays. They are not: the pages are mapped ``PROT_READ``, so a write would
    fault rather than change a daemon's tensor, and nothing here writes. ``owner``: the window, kept
    alive (its address range reserved) by every array made from this.
    """

    def __init__(self, addr: int, shape: tuple[int, int], owner: "RowWindow") -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (addr, False), "shape": shape, "typestr": "|u1", "version": 3}


class RowWindow:
    """The shards of one table (``rows[k]`` rows of ``row_bytes`` each) in one address range.

    ``first[k]``: the row of :attr:`array` where shard ``k``'s rows begin;
    ``delta[k] = first[k] - row_start[k]`` turns a row of the whole table into
    its row of the window. Hold :attr:`lock` while binding and gathering: a
    rebind or :meth:`close` replaces what a gather would read. A part that is
    not bound (or no longer: rebound, closed) reads as zeros, never as another
    mapping, and the range stays reserved while any array of the window lives
    (a traceback's, say); it is given back when the last one goes.

    Raises (constructor):
        ShmError: not supported here, or the range cannot be reserved.
    """

    def __init__(self, rows: Sequence[int], row_bytes: int, row_starts: Sequence[int]) -> None:
        import numpy as np

        libc = _load()
        if libc is None:
            raise ShmError(errno.ENOSYS, "mapping at an address needs 64-bit Linux")
        if row_bytes <= 0:
            raise ShmError(errno.EINVAL, "a window needs rows of at least one byte")
        self.row_bytes = w = row_bytes
        grid = math.lcm(_HUGE, w)
        if grid > _MAX_GRID:
            grid = math.lcm(_PAGE, w)
        self._sizes = [-(-r * w // grid) * grid for r in rows]
        self._starts = [sum(self._sizes[:k]) for k in range(len(rows))]
        self._span = max(_PAGE, sum(self._sizes))
        self.rows = list(rows)
        self._libc = libc
        # reserved with room to start at a huge-page boundary (a huge-page tmpfs maps 2 MiB at a time there)
        reserved = self._span + _HUGE
        self._region = _check(
            libc.mmap(None, reserved, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0),
            f"reserving {reserved} bytes of address space",
        )
        self._reserved = reserved
        self._base = -(-self._region // _HUGE) * _HUGE
        self.first = [s // w for s in self._starts]
        self.delta = np.array([f - a for f, a in zip(self.first, row_starts)], dtype=np.int64)
        self.array: Any = np.asarray(_Raw(self._base, (self._span // w, w), self))
        self._bound: list[tuple[str, int, int] | None] = [None] * len(rows)
        self.lock = threading.Lock()
        self.closed = False

    def bind(self, k: int, view: ShardView) -> None:
        """Map the slot ``view`` names as shard ``k`` (nothing to do if it is mapped there already).

        Raises:
            ShmError: the slot does not fit shard ``k`` or cannot be mapped (shard ``k`` is then unmapped).
        """
        key = (view.region, view.offset, view.nbytes)
        if self._bound[k] == key:
            return
        if self.closed:
            raise ShmError(errno.EBADF, "the window is closed")
        w = self.row_bytes
        if view.nbytes != self.rows[k] * w or view.offset % _PAGE:
            raise ShmError(errno.EINVAL, f"{view.region}+{view.offset}: {view.nbytes} bytes do not fit shard {k}")
        self._unbind(k)
        if not view.nbytes:
            self._bound[k] = key
            return
        if not valid_name(view.region):
            raise ShmError(errno.EINVAL, f"{view.region!r} is not a tensorwire shared-memory region name")
        path = os.path.join(SHM_DIR, view.region)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmError(exc.errno, f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < view.offset + view.nbytes:
                raise ShmError(errno.EINVAL, f"{path} is not a region of {view.offset + view.nbytes} bytes")
            length = min(self._sizes[k], -(-view.nbytes // _PAGE) * _PAGE)
            _check(
                self._libc.mmap(
                    self._base + self._starts[k],
                    length,
                    _PROT_READ,
                    mmap.MAP_SHARED | _MAP_FIXED | _MAP_POPULATE,
                    fd,
                    view.offset,
                ),
                f"mapping {path}",
            )
        finally:
            os.close(fd)
        self._bound[k] = key

    def _unbind(self, k: int) -> None:
        """Map zeros over shard ``k``'s part (its slot's memory is let go; a stale read reads zeros)."""
        if self._bound[k] is None or not self._sizes[k]:
            self._bound[k] = None
            return
        self._bound[k] = None
        _check(
            self._libc.mmap(
                self._base + self._starts[k],
                self._sizes[k],
                _PROT_READ,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED,
                -1,
                0,
            ),
            "unmapping a shard",
        )

    def regions(self) -> list[str]:
        """The regions mapped now."""
        return [b[0] for b in self._bound if b is not None and b[2]]

    def close(self) -> None:
        """Let every slot go (zeros in their place). Idempotent; the caller holds :attr:`lock` (or no other
        thread uses the window). The address range itself goes with the last array of the window."""
        if self.closed:
            return
        self.closed = True
        for k in range(len(self._bound)):
            self._unbind(k)
        self.array = None

    def __del__(self) -> None:  # no array of the window is left: give the address range back
        if getattr(self, "_reserved", 0):
            self._libc.munmap(self._region, self._reserved)
            self._reserved = 0
