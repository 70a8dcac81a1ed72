"""The shared host memory of one pair of processes: a process-shared lock, a table of channels, entries, flags.

One region per pair of ranks on one host, made by the lower rank as a file
under ``/dev/shm`` (mode 0600, a random name handed to the peer over the
group's connection set-up, unlinked once both mapped it), mapped by both, and
registered with CUDA by both (pinned, device-mapped): its flag words are read
and written by both hosts and both GPUs. Layout (little-endian)::

    0      magic u64, version u32
    64     a robust, process-shared pthread mutex (64 bytes reserved)
    128    per side (lower rank = side 0): pid u64, pid namespace u64, heartbeat u64, closed u64 (32 bytes each)
    256    channel table: CHANNELS x u64 (0 free, else key + 1)
    768    per side: in a large send's wait for its receiver u32 (0/1), such waits given up u32 (8 bytes each)
    4096   channels: CHANNELS x (ENTRIES + GRAPH_ENTRIES) entries of ENTRY bytes

A channel is one direction of one torch tag between the pair: key
``2 * tag + sending side``. Message ``s`` (1, 2, ...) of a channel uses entry
``(s - 1) % ENTRIES``::

    0   src_ready   u32  the sender's stream reached the send (written by the sender's GPU when it came first)
    4   dst_ready   u32  the receiver's stream reached the receive (receiver's GPU, when it came first)
    8   landed      u32  the bytes are in the receiver's memory (written after the copy, by whoever copied)
    12  recv_done   u32  the receiver's stream copied them out of its staging buffer (staged receives only)
    64  seq u32, state u32 (SENT | RECEIVED | FAILED | STAGED), error u32
    96  the sender's block, 240 the receiver's: signature (8 x i64), nbytes u64, offset u64, IPC handle (64 bytes)

The flag words hold sequence numbers and are compared cyclically (``>=`` on
``int32`` differences), so they only ever move forward and never need a reset.

Messages captured in a CUDA graph use the channel's graph entries instead
(``GRAPH_ENTRIES`` after its ring, one per captured message for good): their
flags hold 0 or 1, and the graph itself resets each flag after waiting on it,
so every replay moves the bytes again (see :mod:`.pair`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import secrets
import struct
import threading
import time
from typing import Any, ClassVar

from ...errors import ProtocolError, TensorWireError, TransferTimeout
from ...settings import setting

__all__ = [
    "Region",
    "ENTRIES",
    "GRAPH_ENTRIES",
    "CHANNELS",
    "SENT",
    "RECEIVED",
    "FAILED",
    "ERR_MISMATCH",
    "ERR_LOST",
    "STAGED",
    "SRC_READY",
    "DST_READY",
    "LANDED",
    "RECV_DONE",
    "Block",
    "BLOCK_BYTES",
    "pack_block",
    "reached",
    "pid_namespace",
    "process_alive",
]

MAGIC = 0x74776365_72656731  # "twceReg1"
VERSION = 1
CHANNELS = 64
ENTRIES = 32
#: entries of messages captured in CUDA graphs, per channel (each captured message has one for good)
GRAPH_ENTRIES = 256
ENTRY = 384
HEADER = 4096
SIZE = HEADER + CHANNELS * (ENTRIES + GRAPH_ENTRIES) * ENTRY
_MUTEX = 64
#: a host spin of this path (the lock's retries, a wait for the peer's flag) hands the GIL over this often
#: (nanoseconds): compiled (mypyc), a loop never lets another thread of the process run, as the interpreter does
#: every switch interval, so a :class:`Spin` releases it (see there)
SPIN_YIELD_NS = 200_000
_SIDES = 128
_TABLE = 256
_PUSH = 768

SRC_READY, DST_READY, LANDED, RECV_DONE = 0, 4, 8, 12
_SEQ = 64
_BLOCKS = (96, 240)  # sender's, receiver's

SENT, RECEIVED, FAILED, STAGED = 1, 2, 4, 8
#: why an entry says FAILED (its error word)
ERR_MISMATCH, ERR_LOST, ERR_TIMEOUT, ERR_CLOSED = 1, 2, 3, 4

_HEAD = struct.Struct("<III")  # seq, state, error
_BLOCK = struct.Struct("<8qQQ64s")  # signature words, nbytes, offset, handle
BLOCK_BYTES = _BLOCK.size
_SIG_BYTES = 72  # the signature words and the byte count: what both sides must agree on
_ADDR = struct.Struct("<Q64s")  # offset, handle: after the signature
_SIDE = struct.Struct("<QQQQ")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PUSH_WORDS = struct.Struct("<II")
_MASK = 0xFFFFFFFF


def pack_block(words: tuple[int, ...], nbytes: int, offset: int, handle: bytes) -> bytes:
    """A block's bytes as :meth:`Region.write_packed` writes them."""
    return _BLOCK.pack(*words, nbytes, offset, handle)


def reached(value: int, seq: int) -> bool:
    """Whether a flag holding ``value`` lets a wait for ``seq`` go on (``(int32_t)(value - seq) >= 0``)."""
    return ((value - seq) & _MASK) < 1 << 31


class Block:
    """What one side of a message writes into its entry: signature words, bytes, and where they are."""

    __slots__ = ("words", "nbytes", "offset", "handle")

    def __init__(self, words: tuple[int, ...], nbytes: int, offset: int, handle: bytes) -> None:
        self.words = words
        self.nbytes = nbytes
        self.offset = offset
        self.handle = handle


class _Mutex:
    """A robust, process-shared pthread mutex living at ``addr`` (inside the region)."""

    _libc: ClassVar[Any] = None

    def __init__(self, addr: int, *, create: bool, spin_us: float = 0.0) -> None:
        #: a lock taken by the peer process is retried (GIL kept) for up to this long before sleeping in the kernel
        self.spin_ns = int(spin_us * 1000)
        #: times the lock was found taken; of those, times this side slept for it; nanoseconds spent waiting
        self.contended = 0
        self.slept = 0
        self.wait_ns = 0
        #: a thread of this process holds the lock (then only a sleep lets it go on: it needs the GIL)
        self._held_here = False
        if _Mutex._libc is None:
            name = ctypes.util.find_library("c") or "libc.so.6"
            # PyDLL: these calls keep the GIL (the lock is held for microseconds; releasing the GIL around every
            # call let another thread take it, and taking it back cost up to the switch interval). Only a lock that
            # is taken already is waited for through CDLL, which releases the GIL: its holder may be a thread of
            # this process, which needs the GIL to go on and unlock.
            libc = ctypes.PyDLL(name)
            for fn in (
                "pthread_mutex_trylock",
                "pthread_mutex_unlock",
                "pthread_mutex_consistent",
                "pthread_mutex_init",
            ):
                getattr(libc, fn).restype = ctypes.c_int
            waiting = ctypes.CDLL(name)
            waiting.pthread_mutex_lock.restype = ctypes.c_int
            _Mutex._libc = (libc, waiting)
        lib, waiting = _Mutex._libc
        self._trylock_fn = lib.pthread_mutex_trylock
        self._lock_fn = waiting.pthread_mutex_lock
        self._unlock_fn = lib.pthread_mutex_unlock
        self._consistent = lib.pthread_mutex_consistent
        self._ptr = ctypes.c_void_p(addr)
        if create:
            attr = ctypes.create_string_buffer(64)
            lib.pthread_mutexattr_init(attr)
            lib.pthread_mutexattr_setpshared(attr, 1)  # PTHREAD_PROCESS_SHARED
            lib.pthread_mutexattr_setrobust(attr, 1)  # PTHREAD_MUTEX_ROBUST: a dead owner does not wedge the peer
            code = lib.pthread_mutex_init(self._ptr, attr)
            lib.pthread_mutexattr_destroy(attr)
            if code:
                raise TensorWireError(f"pthread_mutex_init: {os.strerror(code)}")

    def __enter__(self) -> None:
        code = self._trylock_fn(self._ptr)
        if code == errno.EBUSY:
            code = self._wait()
        if code == errno.EOWNERDEAD:  # the peer died holding it: the region's state is still consistent per entry
            self._consistent(self._ptr)
        elif code:
            raise TensorWireError(f"pthread_mutex_lock: {os.strerror(code)}")
        self._held_here = True

    def __exit__(self, *exc: Any) -> None:
        self._held_here = False
        self._unlock_fn(self._ptr)

    def _wait(self) -> int:
        """Take the lock that :meth:`__enter__` found taken; returns pthread's code.

        Its holder is most often the peer process, inside a few microseconds of Python (both sides of a message
        arrive at once in a ping-pong). Sleeping in the kernel for it costs the wake-up of a sleeping thread,
        tens of microseconds and more on an idle core, so the lock is retried first, for up to ``spin_ns``. Not
        when a thread of this process holds it: that one needs the GIL to go on, so this one sleeps at once. (A
        thread of this process that has taken the lock but not yet set ``_held_here`` is spun for, at most
        ``spin_ns``, before this one sleeps: the cost of that race is bounded, and the lock is taken either way.)
        """
        clock = time.perf_counter_ns
        t0 = clock()
        self.contended += 1
        code = errno.EBUSY
        if not self._held_here:
            spin = Spin(self.spin_ns)
            while code == errno.EBUSY and not spin.over():
                code = self._trylock_fn(self._ptr)
        if code == errno.EBUSY:
            self.slept += 1
            code = self._lock_fn(self._ptr)
        self.wait_ns += clock() - t0
        return code


class Spin:
    """The clock of one bounded host spin of ``budget_ns`` nanoseconds: :meth:`over` says when it is up, and
    meanwhile hands the GIL over every :data:`SPIN_YIELD_NS`."""

    def __init__(self, budget_ns: int) -> None:
        now = time.perf_counter_ns()
        self.deadline = now + budget_ns
        self._hand_over = now + SPIN_YIELD_NS

    def over(self) -> bool:
        """Whether the spin's time is up. When a hand-over is due, releases the GIL and takes it again
        (``time.sleep(0)``): a thread of this process that has waited for it past the switch interval gets it then
        (the interpreter's own hand-over: a thread asking for the GIL that long makes the holder's next release
        wait until the asker took it)."""
        now = time.perf_counter_ns()
        if now >= self.deadline:
            return True
        if now >= self._hand_over:
            time.sleep(0)
            self._hand_over = now + SPIN_YIELD_NS
        return False


class Region:
    """The mapped region of one pair (see the module docstring).

    Args:
        path: the file (made by :meth:`create`, opened by :meth:`attach`).
        side: 0 for the lower rank of the pair, 1 for the higher.
    """

    def __init__(self, path: str, side: int, *, create: bool) -> None:
        self.path = path
        self.side = side
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SIZE)
            elif os.fstat(fd).st_size != SIZE:
                raise ProtocolError(
                    f"the peer's copy-engine region {path} has {os.fstat(fd).st_size} bytes, not {SIZE}"
                )
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.buf = memoryview(self._map)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if create:
            struct.pack_into("<QI", self.buf, 0, MAGIC, VERSION)
        else:
            magic, version = struct.unpack_from("<QI", self.buf, 0)
            if magic != MAGIC or version != VERSION:
                raise ProtocolError(f"{path} is not a copy-engine region of this version ({magic:#x}, {version})")
        self.mutex = _Mutex(self.addr + _MUTEX, create=create, spin_us=setting("ce_lock_spin_us"))
        self.device_addr = 0  # set once registered with CUDA (:meth:`register`)
        #: host waits of a side that came to an entry still in use (ENTRIES messages ahead on a channel)
        self.full_waits = 0
        self._channels: dict[int, int] = {}
        self._closed = False
        self._lock = threading.Lock()
        _SIDE.pack_into(self.buf, _SIDES + 32 * side, os.getpid(), pid_namespace(), 1, 0)

    @classmethod
    def create(cls, directory: str = "/dev/shm") -> "Region":
        """A new region (side 0) under ``directory`` with a random name."""
        return cls(os.path.join(directory, f"tensorwire-ce-{os.getpid()}-{secrets.token_hex(12)}"), 0, create=True)

    @classmethod
    def attach(cls, path: str) -> "Region":
        """The peer's region (side 1); the file is unlinked once mapped (nobody else can open it from then on)."""
        if not os.path.basename(path).startswith("tensorwire-ce-"):
            raise ProtocolError(f"refusing to map {path!r}: not a tensorwire copy-engine region")
        region = cls(path, 1, create=False)
        try:
            os.unlink(path)
        except OSError:
            pass
        return region

    # -- sides --------------------------------------------------------------------------------------------
    def beat(self) -> None:
        """Advance this side's heartbeat (the watchdog does, a few times a second)."""
        off = _SIDES + 32 * self.side + 16
        (n,) = _U64.unpack_from(self.buf, off)
        _U64.pack_into(self.buf, off, n + 1)

    def peer_state(self) -> tuple[int, int, int, int]:
        """The peer side's ``(pid, pid namespace, heartbeat, closed)``."""
        return _SIDE.unpack_from(self.buf, _SIDES + 32 * (1 - self.side))

    def push_waiting(self, on: bool) -> None:
        """Say whether this side is in a large send's host wait for its receiver (``CePair._await_receiver``)."""
        _U32.pack_into(self.buf, _PUSH + 8 * self.side, 1 if on else 0)

    def push_gave_up(self) -> None:
        """Count a wait this side gave up because the peer was waiting in a send too (the peer sees it change)."""
        off = _PUSH + 8 * self.side + 4
        (n,) = _U32.unpack_from(self.buf, off)
        _U32.pack_into(self.buf, off, (n + 1) & _MASK)

    def peer_push(self) -> tuple[int, int]:
        """The peer's ``(in a send's wait for its receiver, waits given up)`` (see :meth:`push_waiting`)."""
        return _PUSH_WORDS.unpack_from(self.buf, _PUSH + 8 * (1 - self.side))

    def mark_closed(self) -> None:
        _U64.pack_into(self.buf, _SIDES + 32 * self.side + 24, 1)

    # -- channels -----------------------------------------------------------------------------------------
    def channel(self, key: int) -> int:
        """The byte offset of channel ``key``'s first entry (claimed in the shared table on first use)."""
        off = self._channels.get(key)
        if off is not None:
            return off
        with self.mutex:
            free = -1
            for i in range(CHANNELS):
                (v,) = _U64.unpack_from(self.buf, _TABLE + 8 * i)
                if v == key + 1:
                    free = i
                    break
                if v == 0 and free < 0:
                    free = i
                    break
            else:
                raise TensorWireError(
                    f"more than {CHANNELS} tags in use between one pair of ranks on the copy-engine path"
                )
            _U64.pack_into(self.buf, _TABLE + 8 * free, key + 1)
        off = self._channels[key] = HEADER + free * (ENTRIES + GRAPH_ENTRIES) * ENTRY
        return off

    def entry(self, channel: int, seq: int) -> int:
        return channel + ((seq - 1) % ENTRIES) * ENTRY

    def graph_entry(self, channel: int, k: int) -> int:
        """The entry of the channel's ``k``-th captured message (1-based)."""
        if not 1 <= k <= GRAPH_ENTRIES:
            raise TensorWireError(
                f"more than {GRAPH_ENTRIES} messages of one tag between one pair of ranks captured in CUDA graphs"
            )
        return channel + (ENTRIES + k - 1) * ENTRY

    def set(self, entry: int, which: int, value: int) -> None:
        """Write a flag from the host (graph entries: their 0/1 flags)."""
        _U32.pack_into(self.buf, entry + which, value & _MASK)

    def flag(self, entry: int, which: int) -> int:
        (v,) = _U32.unpack_from(self.buf, entry + which)
        return int(v)

    def release(self, entry: int, which: int, seq: int) -> None:
        """Move a flag forward to ``seq`` from the host (never back)."""
        if not reached(self.flag(entry, which), seq):
            _U32.pack_into(self.buf, entry + which, seq & _MASK)

    def head(self, entry: int) -> tuple[int, int, int]:
        return _HEAD.unpack_from(self.buf, entry + _SEQ)

    def set_head(self, entry: int, seq: int, state: int, error: int = 0) -> None:
        _HEAD.pack_into(self.buf, entry + _SEQ, seq & _MASK, state, error)

    def write_block(self, entry: int, sender: bool, block: Block) -> None:
        _BLOCK.pack_into(
            self.buf, entry + _BLOCKS[0 if sender else 1], *block.words, block.nbytes, block.offset, block.handle
        )

    def write_packed(self, entry: int, sender: bool, packed: bytes) -> None:
        """Write a block packed once by :func:`pack_block` (a channel's blocks repeat message after message)."""
        off = entry + _BLOCKS[0 if sender else 1]
        self.buf[off : off + BLOCK_BYTES] = packed

    def same_signature(self, entry: int, sender: bool, packed: bytes) -> bool:
        """Whether the block in the entry has the signature and byte count of ``packed`` (no unpacking)."""
        off = entry + _BLOCKS[0 if sender else 1]
        return self.buf[off : off + _SIG_BYTES] == packed[:_SIG_BYTES]

    def address(self, entry: int, sender: bool) -> tuple[int, bytes]:
        """``(offset, IPC handle)`` of the block in the entry."""
        return _ADDR.unpack_from(self.buf, entry + _BLOCKS[0 if sender else 1] + _SIG_BYTES)

    def read_block(self, entry: int, sender: bool) -> Block:
        v = _BLOCK.unpack_from(self.buf, entry + _BLOCKS[0 if sender else 1])
        return Block(tuple(v[:8]), v[8], v[9], v[10])

    def wait_free(self, entry: int, deadline: float) -> None:
        """Host wait (rare: a side ENTRIES messages ahead of the other on one channel) -- see Channel.arrive."""
        self.full_waits += 1
        if time.monotonic() > deadline:
            raise TransferTimeout(
                f"the peer is {ENTRIES} messages behind on one tag of the copy-engine path and did not catch up"
            )
        time.sleep(0.00005)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.mark_closed()
        self.buf.release()
        try:
            self._map.close()
        except BufferError:  # a view still exported (ctypes): unmapped with the object
            pass
        if self.side == 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def pid_namespace() -> int:
    """The inode of this process's pid namespace (pids of two processes compare only within one)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) runs: not gone, and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # the state letter follows the command name, which is in parentheses and may itself hold spaces
    end = stat.rfind(b")")
    return stat[end + 2 : end + 3] not in (b"Z", b"X")
