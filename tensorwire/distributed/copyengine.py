"""CUDA tensors of ``backend="tensorwire"`` between ranks of one host: the copy-engine path.

At group creation every rank says on the group's store whether it can take the
path (CUDA, the driver's entry points, ``TENSORWIRE_CUDA_PATH`` not ``ucx``) and
which host it is on; for every pair of ranks on one host that both can, the
lower rank makes the pair's shared region and hands its name over the store to
the higher one, which maps it (and unlinks it: nobody else can open it after
that) and says so. From then on every CUDA ``isend``/``irecv`` between the two
is a :class:`~tensorwire.transport.ce.CePair` message: the caller's thread
queues a flag write, or a flag wait, one copy-engine copy and a flag write, and
returns (:mod:`tensorwire.transport.ce.pair`); host tensors keep going over the
pair's link.

``wait()`` without a timeout makes the caller's current stream wait (a flag
wait, microseconds of host time); ``wait(timeout)`` and ``is_completed()`` look at
the flag in host memory. A watchdog thread per group looks at every pair a few
times a second: a peer that died, closed or stopped beating, or a message older
than the group's timeout, fails the pair -- every stream waiting on it is
released, every pending work fails, and the next call raises.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..cuda import current_raw_stream
from ..errors import ProtocolError, TensorWireError
from ..settings import setting
from ..transport.ce import CeDriver, CeOp, CePair, Exports, Region
from .errors import SignatureMismatch, WorkTimeout, translate
from .signatures import Signature, decode, signature_of
from .work import Work

if TYPE_CHECKING:  # pragma: no cover
    from .channel import Peer

__all__ = ["CeWork", "setup", "isend", "irecv", "Watchdog", "capable"]

log = logging.getLogger(__name__)

#: how often the watchdog looks at the pairs
WATCH_S = 0.05


def capable() -> str | None:
    """Why this process cannot take the copy-engine path (None: it can). Does not create a CUDA context."""
    choice = setting("cuda_path")
    if choice == "ucx":
        return "TENSORWIRE_CUDA_PATH=ucx"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm for the pair's shared region"
    try:
        CeDriver.get()
    except TensorWireError as exc:
        return str(exc)
    return None


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def setup(store: Any, prefix: str, rank: int, peers: dict[int, "Peer"], timeout: float) -> "Watchdog | None":
    """Give each peer on this host its :class:`CePair` (``peer.ce``) where both ranks can; returns the watchdog.

    Every rank of the group calls it at creation, after the links are made (it waits on the store for the
    others' answers, ``timeout`` at most).
    """
    why = capable()
    required = setting("cuda_path") == "ce"
    me = f"{'1' if why is None else '0'}|{_host_id()}"
    store.set(f"{prefix}ce/host/{rank}", me)
    if why is not None:
        if required:
            raise TensorWireError(f"TENSORWIRE_CUDA_PATH=ce, but this rank cannot take the copy-engine path: {why}")
        log.info("tensorwire.distributed: rank %d: CUDA tensors go over UCX (%s)", rank, why)
    exports: Exports | None = None
    pairs: list[CePair] = []
    for other in sorted(peers):
        theirs = _get(store, f"{prefix}ce/host/{other}", timeout)
        ok, _, host = theirs.partition("|")
        if why is not None:
            continue
        if ok != "1" or host != _host_id():
            reason = "rank on another host" if host != _host_id() else "the peer cannot take it"
            if required:
                raise TensorWireError(f"TENSORWIRE_CUDA_PATH=ce, but rank {other} cannot: {reason}")
            log.info("tensorwire.distributed: rank %d <-> %d: CUDA tensors over UCX (%s)", rank, other, reason)
            continue
        pair_key = f"{prefix}ce/pair/{min(rank, other)}-{max(rank, other)}"
        region: Region | None = None
        try:
            if rank < other:
                region = Region.create()
                store.set(pair_key, region.path)
                answer = _get(store, pair_key + "/ok", timeout)
                if answer != "1":
                    raise TensorWireError(f"rank {other} could not map the pair's region: {answer}")
            else:
                path = _get(store, pair_key, timeout)
                try:
                    region = Region.attach(path)
                except (OSError, TensorWireError) as exc:
                    store.set(pair_key + "/ok", f"{type(exc).__name__}: {exc}")
                    raise
                store.set(pair_key + "/ok", "1")
        except (OSError, TensorWireError) as exc:
            if region is not None:
                region.close()
            if required:
                raise
            log.warning("tensorwire.distributed: rank %d <-> %d: CUDA tensors over UCX: %s", rank, other, exc)
            continue
        if exports is None:
            exports = _exports()
        peer = peers[other]
        pair = CePair(
            region,
            rank=rank,
            peer=other,
            timeout=timeout,
            exports=exports,
            mismatch=_mismatch_text(rank, other),
            peer_timeout=max(5.0, min(timeout, 30.0)),
        )
        peer.ce = pair
        pairs.append(pair)
    if not pairs:
        return None
    log.info(
        "tensorwire.distributed: rank %d: CUDA tensors to %d rank(s) of this host over the copy-engine path",
        rank,
        len(pairs),
    )
    return Watchdog(pairs, rank)


def _get(store: Any, key: str, timeout: float) -> str:
    from datetime import timedelta

    store.wait([key], timedelta(seconds=timeout))
    return bytes(store.get(key)).decode()


_EXPORTS: list[Exports] = []


def _exports() -> Exports:
    if not _EXPORTS:
        _EXPORTS.append(Exports(CeDriver.get()))
    return _EXPORTS[0]


def _mismatch_text(rank: int, other: int) -> Any:
    def text(mine: tuple[int, ...], theirs: tuple[int, ...], sending: bool) -> str | None:
        a, b = decode(mine), decode(theirs)
        sent, into = (a, b) if sending else (b, a)
        if sent.fills(into):
            return None
        src, dst = (rank, other) if sending else (other, rank)
        return f"rank {src} sends {sent.describe()}; rank {dst} receives into {into.describe()}"

    return text


class CeWork(Work):
    """``isend``/``irecv`` of a CUDA tensor on the copy-engine path."""

    def __init__(self, peer: "Peer", op: CeOp | None, sig: Signature, tag: int, tensor: torch.Tensor, sending: bool):
        super().__init__(peer.timeout, [tensor])
        self._peer = peer
        self._op = op
        self._sig = sig
        self._tag = tag
        self._sending = sending
        self._completer = peer.completer
        self._device = tensor.device.index
        if not sending:
            self._source = peer.peer

    def _describe(self) -> str:  # (built only when an error or a timeout names the work)
        verb, prep = ("isend", "to") if self._sending else ("irecv", "from")
        return f"{verb} of {self._sig.describe()} {prep} rank {self._peer.peer} (tag {self._tag}, copy engine)"

    def _attach(self, op: CeOp) -> None:
        self._op = op
        op.on_done = self._op_done
        if op.poll():
            self._op_done(op.error)

    def _op_done(self, exc: BaseException | None) -> None:
        if exc is not None:
            exc = _translated(exc, self._what)
        self._finish(exc)

    def _finished(self, exc: BaseException | None, streamed: bool) -> None:
        if exc is not None and streamed:
            self._peer.async_failure(exc, self._what)

    def _poll(self) -> None:
        op = self._op
        if op is not None:
            op.poll()

    def _drive(self, deadline: float) -> None:
        op = self._op
        spin_until = time.monotonic() + 0.0002
        while not self._is_done:
            if op is not None and op.poll():
                return
            now = time.monotonic()
            if now >= deadline:
                raise WorkTimeout(f"{self._what} not complete within {self._wait_seconds:.3g} s")
            if now > spin_until:
                time.sleep(0.0001)

    def _stream_wait(self) -> bool:
        op = self._op
        if op is None or op.poll():
            return True  # complete (its bytes are in place) or failed: wait() reports it
        stream = current_raw_stream(self._device)
        if stream != op.stream:  # (on the stream the copy went on, the wait is in order already)
            driver = op.pair.driver
            driver.context(self._device)
            driver.wait(stream, op.flag_device_addr, op.seq)
        self._mark_streamed()
        return True


def _translated(exc: BaseException, what: str) -> BaseException:
    if isinstance(exc, ProtocolError) and not isinstance(exc, SignatureMismatch):
        return SignatureMismatch(f"{what}: {exc}")
    return translate(exc, what)


def isend(peer: "Peer", pair: CePair, tensor: torch.Tensor, tag: int) -> CeWork:
    return _message(peer, pair, tensor, tag, sending=True)


def irecv(peer: "Peer", pair: CePair, tensor: torch.Tensor, tag: int) -> CeWork:
    return _message(peer, pair, tensor, tag, sending=False)


def _message(peer: "Peer", pair: CePair, tensor: torch.Tensor, tag: int, *, sending: bool) -> CeWork:
    sig, words = signature_of(tensor)
    work = CeWork(peer, None, sig, tag, tensor, sending)
    if peer.error is not None:
        work._finish(peer.error)
        return work
    if sending and tensor.requires_grad:
        tensor = tensor.detach()
    try:
        device = work._device
        call = pair.send if sending else pair.recv
        op = call(tensor, tag + 1, words, sig.nbytes, current_raw_stream(device), device, work._what)
    except ProtocolError as exc:  # the peer came first with another signature: both sides fail this message
        work._finish(_translated(exc, work._what))
        return work
    except BaseException as exc:  # noqa: BLE001
        work._finish(peer.fail(exc, work._what))
        return work
    work._attach(op)
    return work


class Watchdog:
    """One thread per group: looks at every copy-engine pair every ``WATCH_S`` (see the module docstring)."""

    def __init__(self, pairs: list[CePair], rank: int) -> None:
        self.pairs = pairs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tw-dist-ce-watchdog-{rank}", daemon=True)
        self._thread.start()

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
                    log.error(
                        "tensorwire.distributed: rank %d <-> rank %d (copy engine): %s", pair.rank, pair.peer, lost
                    )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
