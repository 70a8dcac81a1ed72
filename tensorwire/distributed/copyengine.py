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
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from .. import observe
from ..cuda import current_raw_stream
from ..errors import PeerLostError, ProtocolError, TensorWireError
from ..settings import setting
from ..transport.ce import CeDriver, CeOp, CePair, Exports, Watchdog, capable, exchange_region, probe_pair
from ..transport.select import host_id
from .errors import SignatureMismatch, WorkTimeout, translate
from .signatures import Signature, decode, signature_of
from .work import Work

if TYPE_CHECKING:  # pragma: no cover
    from .channel import Peer

__all__ = ["CeWork", "setup", "isend", "irecv"]

log = logging.getLogger(__name__)

#: the longest the set-up probe of one pair may take (at group creation; the group's timeout if shorter)
PROBE_TIMEOUT_S = 30.0


def setup(store: Any, prefix: str, rank: int, peers: dict[int, "Peer"], timeout: float) -> Watchdog | None:
    """Give each peer on this host its :class:`CePair` (``peer.ce``) where both ranks can; returns the watchdog.

    Every rank of the group calls it at creation, after the links are made (each pair agrees over the store,
    ``timeout`` at most). A pair on another host, or where either side cannot, keeps CUDA tensors on UCX.
    """
    why = capable()
    if why is not None:
        log.info("tensorwire.distributed: rank %d: CUDA tensors go over UCX (%s)", rank, why)
    watchdog: Watchdog | None = None
    for other in sorted(peers):
        peer = peers[other]
        same_host = peer.link.peer_host == host_id()
        why_pair = why if same_host else (why or "rank on another host")
        region = exchange_region(
            store,
            f"{prefix}ce/pair/{min(rank, other)}-{max(rank, other)}",
            lower=rank < other,
            why_not=why_pair,
            timeout=timeout,
        )
        if region is None:
            continue
        pair = CePair(
            region,
            rank=rank,
            peer=other,
            timeout=timeout,
            exports=_exports(),
            mismatch=_mismatch_text(rank, other),
            peer_timeout=max(5.0, min(timeout, 30.0)),
        )
        try:
            failed = _probe(store, f"{prefix}ce/probe/{min(rank, other)}-{max(rank, other)}", pair, timeout)
        except BaseException:  # (the store failed us: the group's creation fails; the pair goes with it)
            pair.close(PeerLostError("the group's creation failed during the copy-engine set-up probe"))
            raise
        peer.ce_probe = pair.probe
        if failed is not None:
            pair.close(PeerLostError(f"the copy-engine set-up probe failed: {failed}"))
            if setting("cuda_path") == "ce":
                raise TensorWireError(f"TENSORWIRE_CUDA_PATH=ce, but the copy-engine probe failed: {failed}")
            log.warning(
                "tensorwire.distributed: rank %d: CUDA tensors to rank %d go over UCX: the copy-engine path's "
                "set-up probe failed (%s)",
                rank,
                other,
                failed,
            )
            continue
        pair.counts = observe.ce_counts(other)  # (the pair counts its messages' parts where tw.metrics() reads)
        peer.ce = pair
        if watchdog is None:
            watchdog = Watchdog(f"tw-dist-ce-watchdog-{rank}")
        watchdog.add(pair)
    if watchdog is not None:
        log.info(
            "tensorwire.distributed: rank %d: CUDA tensors to %d rank(s) of this host over the copy-engine path "
            "(per-message driver calls through %s)",
            rank,
            len(watchdog.pairs),
            getattr(watchdog.pairs[0].driver, "bindings", "a stand-in driver"),
        )
    return watchdog


def _probe(store: Any, key: str, pair: CePair, timeout: float) -> str | None:
    """Run the pair's set-up probe (:func:`~tensorwire.transport.ce.probe_pair`) on this rank's current GPU; None:
    passed or not run.

    It runs where both ranks have picked their GPU before making the group (CUDA initialised: the current device
    is the rank's, as after ``torch.cuda.set_device(local_rank)``); otherwise it would make a CUDA context on a
    device the rank may never use, so it is skipped (both sides agree on the store) and said in the log.
    """
    dev = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    mine = "-" if dev is None else f"{dev}:{_gpu_uuid(dev)}"
    store.set(f"{key}/device/{pair.rank}", mine)
    theirs = f"{key}/device/{pair.peer}"
    store.wait([theirs], timedelta(seconds=max(0.1, timeout)))
    word = bytes(store.get(theirs)).decode()
    if dev is None or word == "-":
        pair.probe = "skipped (CUDA not initialised at group creation: no GPU chosen yet)"
        log.info("tensorwire.distributed: rank %d <-> rank %d: copy-engine probe %s", pair.rank, pair.peer, pair.probe)
        return None
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.device(dev), torch.cuda.stream(stream):  # (the probe's buffers are filled on its stream)
        failed = probe_pair(
            pair,
            store,
            key,
            device=dev,
            stream=stream.cuda_stream,
            alloc=lambda n: torch.empty(n, dtype=torch.uint8, device=dev),
            idle=stream.query,
            timeout=min(timeout, PROBE_TIMEOUT_S),
            torch=torch,
        )
    pair.probe = "passed" if failed is None else f"failed: {failed}"
    same = same_gpu(mine, word)
    if same is not None:  # (known before any message: captured flags can pick their calls from the first step)
        pair.peer_gpu(dev, same)
    return failed


def _gpu_uuid(dev: int) -> str:
    """The GPU's UUID (the same in every process, whatever each one's ``CUDA_VISIBLE_DEVICES``), or ""."""
    try:
        return str(torch.cuda.get_device_properties(dev).uuid)
    except (AttributeError, RuntimeError):  # (a torch without it)
        return ""


def same_gpu(mine: str, theirs: str) -> bool | None:
    """Whether two ranks' set-up words (``"<index>:<uuid>"``, ``"-"``: no GPU chosen) name one GPU; None: unknown."""
    a, b = mine.partition(":")[2], theirs.partition(":")[2]
    return a == b if a and b else None


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

    __slots__ = ("_peer", "_op", "_sig", "_tag", "_sending", "_device")

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
        if op._done:  # (failed by the watchdog before the callback was there)
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
        if op is not None and op.graph:  # captured: the host cannot wait for a replay; order the stream instead
            op.pair.order_after(op, current_raw_stream(self._device), self._device)
            return
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
        op.pair.order_after(op, current_raw_stream(self._device), self._device)
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
    try:
        device = work._device
        call = pair.send if sending else pair.recv
        op = call(tensor, tag + 1, words, sig.nbytes, current_raw_stream(device), device, work._describe)
    except ProtocolError as exc:  # the peer came first with another signature: both sides fail this message
        work._finish(_translated(exc, work._what))
        return work
    except BaseException as exc:  # noqa: BLE001
        work._finish(peer.fail(exc, work._what))
        return work
    work._attach(op)
    return work
