"""What the kernel offers cross-memory attach: ``process_vm_readv``/``process_vm_writev`` and ``prctl``
through ctypes (the GIL is released during the calls), the threads that copy a large message in pieces,
and Yama's ptrace grant.

Permissions: ``process_vm_writev`` needs the right to ptrace the target (same
user and dumpable, or ``CAP_SYS_PTRACE``). Under Yama ``ptrace_scope`` 1 the
target must also name its writer with ``prctl(PR_SET_PTRACER, pid)``; the kernel
keeps one such name per process, and names it *and its descendants*. So a
process grants its only CMA peer by pid, and once it has several, their nearest
common ancestor (under ``torchrun`` the launcher process of the node, whose
children are the ranks). The grant is never narrowed while the process lives.
Scopes 2 and 3 need ``CAP_SYS_PTRACE``: the probe finds out.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

from tensorwire.cpus import usable_cpus

__all__ = [
    "PIECE_MIN",
    "load_libc",
    "supported",
    "address_of",
    "copy_piece",
    "copy",
    "default_threads",
    "ptrace_scope",
    "common_ancestor",
    "grant_ptrace",
    "pidns",
]

log = logging.getLogger(__name__)

#: A message is split into pieces of at least this many bytes for the copy threads. Handing a piece to a
#: thread costs a wake-up and a wait: 1 MiB in four 256 KiB pieces took 1013 us per round trip on a 16-core
#: host against 828 us in one piece (bench/results/archive/distributed_h100_2026-11-24-4.md and -2), while 16 MiB
#: and more in four pieces copy at 11-15 GB/s; so a message is split only from 2 MiB.
PIECE_MIN = 1 << 20
_PAGE = 4096
_PR_SET_PTRACER = 0x59616D61


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _Libc:
    """``process_vm_readv``, ``process_vm_writev`` and ``prctl`` of the C library (GIL released in calls)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.readv = libc.process_vm_readv
        self.writev = libc.process_vm_writev
        for fn in (self.readv, self.writev):
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
            fn.restype = ctypes.c_ssize_t
        self.prctl = libc.prctl
        self.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        self.prctl.restype = ctypes.c_int


_LIBC: _Libc | None = None
_LIBC_ERROR: str | None = None
_LIBC_LOCK = threading.Lock()


def load_libc() -> _Libc | None:
    global _LIBC, _LIBC_ERROR
    if _LIBC is None and _LIBC_ERROR is None:
        with _LIBC_LOCK:
            if _LIBC is None and _LIBC_ERROR is None:
                try:
                    _LIBC = _Libc()
                except (OSError, AttributeError) as exc:  # not Linux, or a C library without these calls
                    _LIBC_ERROR = str(exc)
    return _LIBC


def supported() -> bool:
    """Whether this process can try cross-memory attach at all (Linux, the calls and pidfds exist)."""
    return load_libc() is not None and hasattr(os, "pidfd_open")


def address_of(view: memoryview) -> int:
    """Address of a writable byte view's first byte.

    Raises:
        TypeError: the view is read-only.
    """
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


# -- the copy ------------------------------------------------------------------------------------------


def _call(fn: Any, pid: int, local: int, remote: int, n: int) -> int:
    liov = _IoVec(local, n)
    riov = _IoVec(remote, n)
    got = int(fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0))
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return got


def copy_piece(fn: Any, pid: int, local: int, remote: int, n: int) -> None:
    """Copy ``n`` bytes; a short count (a fault part-way) is resumed once more to learn its errno."""
    done = 0
    while done < n:
        got = _call(fn, pid, local + done, remote + done, n - done)
        if got == 0:
            raise OSError(errno.EFAULT, "no byte copied")
        done += got


_POOL: tuple[int, ThreadPoolExecutor] | None = None  # (pid that made it, the pool)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """The process's copy threads (made on first use; again in a forked child, whose copy of the
    parent's pool has no threads)."""
    global _POOL
    pid = os.getpid()
    if _POOL is None or _POOL[0] != pid:
        with _POOL_LOCK:
            if _POOL is None or _POOL[0] != pid:
                _POOL = (pid, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tensorwire-cma"))
    return _POOL[1]


def default_threads() -> int:
    """Copy threads per message under ``TENSORWIRE_CMA_THREADS=0``: a quarter of the CPUs this process may use
    (:func:`tensorwire.cpus.usable_cpus`: its affinity, its cgroup's quota), 2 to 4 (1 on one CPU).

    Two even on two cores: while a message is copied its receiver waits, so a second core is free (16 MiB
    ping-pong on a 2-core VM: 4.1-5.2 ms per round trip with two threads, 8.0-8.5 ms with one, in turns).
    """
    cores = usable_cpus()
    return 1 if cores < 2 else max(2, min(4, cores // 4))


def copy(fn: Any, pid: int, local: int, remote: int, n: int, *, threads: int) -> None:
    """Copy ``n`` bytes between this process (``local``) and ``pid`` (``remote``) with ``fn``
    (``process_vm_writev`` or ``process_vm_readv``), in up to ``threads`` pieces at once.

    Returns after every piece finished, also when one failed.

    Raises:
        OSError: the first failure (ESRCH before any other: the peer is gone).
    """
    pieces = min(threads, n // PIECE_MIN)
    if pieces <= 1:
        copy_piece(fn, pid, local, remote, n)
        return
    size = -(-n // pieces)
    size = -(-size // _PAGE) * _PAGE
    futures: list[Future[None]] = []
    pool = _pool(max(1, threads - 1))
    for off in range(size, n, size):
        futures.append(pool.submit(copy_piece, fn, pid, local + off, remote + off, min(size, n - off)))
    errors: list[OSError] = []
    try:
        copy_piece(fn, pid, local, remote, min(size, n))
    except OSError as exc:
        errors.append(exc)
    for f in futures:
        failure = f.exception()
        if failure is not None:
            errors.append(failure if isinstance(failure, OSError) else OSError(errno.EIO, str(failure)))
    if errors:
        errors.sort(key=lambda e: e.errno != errno.ESRCH)
        raise errors[0]


# -- Yama -------------------------------------------------------------------------------------------------


def ptrace_scope() -> int:
    """Yama's ``kernel.yama.ptrace_scope`` (0 when Yama is not there)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return int(stat[stat.rindex(")") + 2 :].split()[1])  # after "(comm) state": ppid


def _ancestry(pid: int) -> list[int]:
    """``pid``, its parent, ... up to the root of this pid namespace (empty if ``pid`` is gone)."""
    chain: list[int] = []
    try:
        while pid > 0 and pid not in chain and len(chain) < 4096:
            chain.append(pid)
            pid = _parent(pid)
    except (OSError, ValueError, IndexError):
        if not chain:
            return []
    return chain


def common_ancestor(chains: Iterable[list[int]]) -> int | None:
    """The nearest process in every chain (each: a process then its ancestors); None: none in common."""
    chains = list(chains)
    if not chains or any(not c for c in chains):
        return None
    others = [set(c) for c in chains[1:]]
    return next((p for p in chains[0] if all(p in s for s in others)), None)


_GRANT_LOCK = threading.Lock()
_GRANTED_PEERS: set[int] = set()
_GRANTED: int | None = None
_GRANT_PID = 0  # the process that granted (a forked child inherits no Yama exception)


def grant_ptrace(
    peer: int,
    *,
    scope: int | None = None,
    prctl: Callable[[int], int] | None = None,
    ancestry: Callable[[int], list[int]] | None = None,
) -> str | None:
    """Let ``peer`` ptrace this process where Yama (``ptrace_scope`` 1) asks for it; None when done,
    else why not. Scope 0: nothing to do; 2 and 3 cannot be granted (the probe tells whether the peer
    has ``CAP_SYS_PTRACE``). Names the one peer, then the nearest common ancestor of every peer and of
    the process named before (so a grant only ever widens). ``prctl`` and ``ancestry`` stand in for
    the system in tests."""
    global _GRANTED, _GRANT_PID
    if scope is None:
        scope = ptrace_scope()
    if scope != 1 or peer == os.getpid():
        return None
    lineage = ancestry or _ancestry
    with _GRANT_LOCK:
        if _GRANT_PID != os.getpid():
            _GRANTED_PEERS.clear()
            _GRANTED, _GRANT_PID = None, os.getpid()
        if peer in _GRANTED_PEERS:
            return None
        mine = lineage(peer)
        if not mine:
            return f"process {peer} is gone"
        chains = [mine] + [c for c in (lineage(p) for p in sorted(_GRANTED_PEERS)) if c]
        if _GRANTED is not None:
            chains += [c for c in (lineage(_GRANTED),) if c]
        target = common_ancestor(chains)
        if target is None:
            return f"processes {sorted(_GRANTED_PEERS | {peer})} have no common ancestor"
        if target != _GRANTED:
            err = prctl(target) if prctl is not None else _set_ptracer(target)
            if err:
                return f"prctl(PR_SET_PTRACER, {target}) failed: {os.strerror(err)}"
            log.info(
                "cross-memory attach under Yama ptrace_scope 1: process %d and its descendants may now ptrace this one",
                target,
            )
            _GRANTED = target
        _GRANTED_PEERS.add(peer)
        return None


def _set_ptracer(pid: int) -> int:
    """``prctl(PR_SET_PTRACER, pid)``: 0 or an errno."""
    libc = load_libc()
    if libc is None:
        return errno.ENOSYS
    if libc.prctl(_PR_SET_PTRACER, pid, 0, 0, 0) != 0:
        return ctypes.get_errno() or errno.EINVAL
    return 0


def pidns() -> tuple[int, int]:
    try:
        st = os.stat("/proc/self/ns/pid")
        return st.st_dev, st.st_ino
    except OSError:
        return 0, 0
