"""The copy-engine path's set-up probe: one real message each way through a new pair before anyone relies on it.

A pair whose region both sides mapped can still be unusable: a container that lets the IPC handle open but not
the peer's memory be reached, GPUs without peer access whose copies fail or stall, a driver without stream memory
operations. Where that is so, the first training step would fail (or hang until the watchdog) -- so at group
creation, before the pair is used, both sides play a message of :data:`PROBE_BYTES` each way through the pair
itself, on a stream of their own, exactly as a training message goes (exports, the peer's mapping, a copy-engine
copy, flag writes and a flag wait), and compare the bytes that arrived with a pattern both know. Each says on the
store whether it passed; the pair is kept only if both did (:func:`probe_pair`), and otherwise closed, its CUDA
tensors going over UCX with one log line saying why (``tensorwire.distributed.copyengine``).

The probe uses the pair's tag 0, which the backend never does (its messages go on ``tag + 1``), and waits on the
host for at most ``timeout``: a copy that never lands fails the pair, which releases every stream waiting on it.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

from ...errors import PeerLostError, TensorWireError

__all__ = ["probe_pair", "PROBE_BYTES", "PROBE_TAG", "pattern"]

#: bytes of each side's probe message
PROBE_BYTES = 64 << 10
#: the pair's tag the probe uses (the backend's own messages use ``tag + 1``)
PROBE_TAG = 0
_PEER_FAILED = "the peer failed its probe"
_WORDS = (1 << 16 | 1, PROBE_BYTES, 0, 0, 0, 0, 0, 0)  # (one dimension of uint8: the signature's words)


def pattern(rank: int, torch: Any) -> Any:
    """The bytes rank ``rank`` sends in its probe (a CPU ``uint8`` tensor; different per rank, never all equal)."""
    return ((torch.arange(PROBE_BYTES, dtype=torch.int64) * 7 + 13 * rank + 1) % 251).to(torch.uint8)


def _await(ops: list[Any], idle: Callable[[], bool], deadline: float, peer_failed: Callable[[], str | None]) -> str:
    """Wait (host, polled) until every op completed and the probe's stream ran dry: ``""``, or why it stopped
    first -- ``deadline`` passed, or the peer said it failed (its messages will then never come)."""
    pause = 0.0001
    while not (all(op.poll() for op in ops) and idle()):
        now = time.monotonic()
        if now >= deadline:
            return "the probe's messages did not complete in time"
        if pause >= 0.004:  # (the store is asked only once the wait is long: a round trip each)
            why = peer_failed()
            if why is not None:
                return why
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return ""


def _peer_word(store: Any, key: str) -> str | None:
    """The peer's word on the store if it has said one yet (``"1"``: passed)."""
    try:
        if not store.check([key]):
            return None
        return bytes(store.get(key)).decode()
    except RuntimeError:
        return None


def _verdict(store: Any, key: str, rank: int, peer: int, mine: str, timeout: float) -> str | None:
    """Publish this side's outcome (``"1"`` or why not) and read the peer's; None when both passed."""
    store.set(f"{key}/{rank}", mine)
    try:
        store.wait([f"{key}/{peer}"], timedelta(seconds=max(0.1, timeout)))
        theirs = bytes(store.get(f"{key}/{peer}")).decode()
    except RuntimeError as exc:  # (torch's stores raise RuntimeError subclasses on a timeout)
        theirs = f"no answer from rank {peer} ({exc})"
    if mine == "1" and theirs == "1":
        return None
    if theirs != "1" and mine in ("1", _PEER_FAILED):
        return f"rank {peer}: {theirs}"
    return mine


def probe_pair(
    pair: Any,
    store: Any,
    key: str,
    *,
    device: Any,
    stream: int,
    alloc: Callable[[int], Any],
    idle: Callable[[], bool],
    timeout: float,
    torch: Any,
) -> str | None:
    """Play one probe message each way through ``pair``; None if both sides got the right bytes, else why not.

    Both sides of the pair call it, each with its own ``device`` (index), ``stream`` (raw handle of a stream
    for the probe's work) and ``alloc(nbytes) -> uint8 tensor`` on that device; ``idle()`` says whether the
    probe's stream ran dry. Both say on ``store`` (under ``key``) whether they passed and read the other's word,
    so both keep or drop the pair alike. A failed probe fails the pair (releasing every stream waiting on it);
    the caller closes it (which keeps the pair's memory mapped while the probe's stream is not yet dry).
    """
    deadline = time.monotonic() + timeout
    mine = "1"
    # a pair closed while the probe's stream still holds work naming its memory keeps that memory mapped
    pair.on_drain(idle)
    try:
        out = alloc(PROBE_BYTES)
        out.fill_(0)  # (the receive buffer must differ from every pattern before the copy)
        src = alloc(PROBE_BYTES)
        src.copy_(pattern(pair.rank, torch))
        ops = [
            pair.send(src, PROBE_TAG, _WORDS, PROBE_BYTES, stream, device, lambda: "the set-up probe's send"),
            pair.recv(out, PROBE_TAG, _WORDS, PROBE_BYTES, stream, device, lambda: "the set-up probe's receive"),
        ]
        theirs = f"{key}/{pair.peer}"

        def peer_failed() -> str | None:
            word = _peer_word(store, theirs)
            return None if word in (None, "1") else _PEER_FAILED

        stopped = _await(ops, idle, deadline, peer_failed)
        if stopped:
            mine = stopped if stopped is _PEER_FAILED else f"{stopped} ({timeout:.3g} s)"
            pair.fail(PeerLostError(f"copy-engine set-up probe with rank {pair.peer}: {mine}"))
        elif any(op.error is not None for op in ops):
            mine = "; ".join(str(op.error) for op in ops if op.error is not None)
        elif not torch.equal(out.cpu(), pattern(pair.peer, torch)):
            mine = "the bytes that arrived differ from what the peer sent"
    except (TensorWireError, RuntimeError, OSError) as exc:  # (a driver error, torch's CUDA errors)
        mine = f"{type(exc).__name__}: {exc}"
        pair.fail(PeerLostError(f"copy-engine set-up probe with rank {pair.peer}: {mine}"))
    return _verdict(store, key, pair.rank, pair.peer, mine, max(0.1, deadline - time.monotonic()))
