"""The process's counts of point-to-point traffic: one :class:`Flow` per (peer, path, direction), plus events.

What is counted (the names under which :mod:`.exporter` publishes them are in
``docs/operations.md``):

- per flow (``peer``, ``path``, ``direction``): messages, bytes and
  completions; for the timed messages (below), the host time each call took
  (``send``/``recv``/``isend``/``irecv`` of a link or of the backend, until it
  returned), and, for operations that complete after their call returned (an
  ``isend`` or ``irecv``), the time from the post to the completion (blocking
  calls count their call time there too);
- events: links negotiated, by the path chosen; fallbacks, with the path
  wanted, the path taken and the reason; errors, by error class; slots and
  bytes held, and bytes mapped from peers, by peer and path.

Paths: ``ucx``, ``tcp``, ``cma`` (TCP links whose large messages go by
cross-memory attach), ``staged`` (CUDA tensors through pinned host memory),
``ce`` (the copy-engine path within a host); ``peer`` is the peer's rank.

Messages, bytes, completions and errors count every message. Latencies are
timed for one message in ``TENSORWIRE_METRICS_SAMPLE`` (16 unless set; 1:
every message) of each route -- a link's name, or a backend peer, direction and
device type -- its first message and every 16th after a timed one. Why: the two
clock readings and the bucket of every message, and following every backend
work to its completion with a time, cost a 4 KiB message over TCP on a 2-core
VM about the whole 1.02x budget of counting (issue 32,
``bench/bench_observe_cost.py``), so a timed message pays them and the others
pay a countdown and a few integer additions -- or, on a route of fixed size
(a Link's static spec), the countdown alone: the route holds its untimed
messages until its next timed one adds them here, and :meth:`Flow.read` adds
what a route still holds (``tallies``). The histograms are then a sample: their
``_count`` is the timed messages, their ``_sum`` those messages' time, and a
mean (``_sum / _count``) or quantile estimates all messages' as any sample
does (while a profiler records, every message is timed).

Latencies go into histograms of power-of-two buckets in microseconds (1, 2,
4 ... 2**24 µs, then +Inf): a bucket is one integer division and one
``bit_length``. Threads of one link can update one flow (the caller's and the
link's sender thread) without a lock (one costs more than the update on a small
VM): the updates come after the last call of the method, and CPython hands the
GIL to another thread only at calls and backward jumps, so no update is lost. A
free-threaded build could lose one where two threads count in the same flow at
the same instant. Reads (:meth:`Flow.read`) may see one message's update half
done, never a count that goes back.

Counting is on unless ``TENSORWIRE_METRICS=0``; :func:`set_enabled` switches it
(benchmarks compare both in one process). Only the standard library and the
leaves are imported here.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tensorwire.settings import setting

__all__ = [
    "BUCKETS_US",
    "CE_PARTS",
    "NBUCKETS",
    "LAST",
    "PATHS",
    "Flow",
    "Registry",
    "REGISTRY",
    "bucket",
    "enabled",
    "set_enabled",
    "sample_every",
    "set_sample_every",
]

#: Upper bounds (µs) of the latency buckets; one more bucket, +Inf, follows.
BUCKETS_US: tuple[int, ...] = tuple(1 << k for k in range(25))
NBUCKETS = len(BUCKETS_US) + 1
LAST = NBUCKETS - 1  # the +Inf bucket
#: The path labels tensorwire uses (a hook may pass another; these are the documented ones).
PATHS = ("ucx", "tcp", "cma", "staged", "ce")


#: The parts a message of the copy-engine path plays on one side (``tensorwire.transport.ce.CePair.counts``): it
#: came first (queued a flag write); came second and copied on the caller's stream; came second and copied on an
#: internal stream; a large send whose receiver came while it waited (it pushed); one whose receiver did not; one that
#: stopped waiting because the peer was waiting in a send to it (an exchange: both send before they receive).
CE_PARTS = ("first", "second_inline", "second_queued", "push_waited", "push_wait_missed", "push_wait_crossed")


_clock = time.perf_counter_ns


def bucket(ns: int) -> int:
    """The bucket of a latency of ``ns`` nanoseconds: ``k`` holds [2**(k-1), 2**k) µs, 0 holds < 1 µs."""
    i = (ns // 1000).bit_length()
    return i if i < LAST else LAST


class Flow:
    """Counts of one (peer, path, direction), written by the threads moving its messages, read by scrapes.

    Every message: ``messages``, ``bytes``; ``open``: posted messages not complete yet (a blocking call's
    message is complete when it returns: only a call that returns before its message completes adds one, its
    completion takes it off; not zeroed by :meth:`reset`, a gauge), so completed messages are
    ``messages - open`` without an update per blocking call. Timed messages only (the sample, see the module docstring), three histograms
    (bucket counts, and the nanoseconds summed): ``sync`` (blocking calls: their call time is their time to
    completion), ``posted`` (calls that return before the message completes) and ``done`` (those messages'
    post -> completion). Exposed as the call-time histogram ``sync + posted`` and the completion histogram
    ``sync + done``. Hooks on a hot path update the fields inline (``bench/bench_observe.py``: each method
    call counts there); the methods are the same updates.
    """

    __slots__ = (
        "peer",
        "path",
        "direction",
        "messages",
        "bytes",
        "open",
        "sync_ns",
        "sync",
        "posted_ns",
        "posted",
        "done_ns",
        "done",
        "tallies",
    )

    def __init__(self, peer: str, path: str, direction: str) -> None:
        self.peer = peer
        self.path = path
        self.direction = direction
        self.open = 0
        #: routes that count their untimed messages themselves (``tensorwire.observe.hooks.Route``: ``pending()``
        #: -> (messages, bytes) not added here yet; ``forget()`` drops them at a reset)
        self.tallies: list[Any] = []
        self.reset()

    def tally(self, route: Any) -> None:
        """``route`` counts messages of this flow on itself until it adds them here (its reads include them)."""
        self.tallies.append(route)

    def untally(self, route: Any) -> None:
        """``route`` stops counting (its link closed): what it still held is added here."""
        k, b = route.pending()
        route.forget()
        self.messages += k
        self.bytes += b
        try:
            self.tallies.remove(route)
        except ValueError:
            pass

    def reset(self) -> None:
        for r in list(self.tallies):
            r.forget()
        self.messages = 0
        self.bytes = 0
        self.sync_ns = 0
        self.sync = [0] * NBUCKETS
        self.posted_ns = 0
        self.posted = [0] * NBUCKETS
        self.done_ns = 0
        self.done = [0] * NBUCKETS

    def called(self, nbytes: int, ns: int) -> None:
        """A blocking call moved one message of ``nbytes`` in ``ns`` ns (timed; also its time to completion)."""
        i = bucket(ns)
        # (no call and no loop from here on: no other thread runs in between; see the module docstring)
        self.messages += 1
        self.bytes += nbytes
        self.sync_ns += ns
        self.sync[i] += 1

    def post(self, nbytes: int, ns: int) -> None:
        """A call posted one message of ``nbytes`` in ``ns`` ns (timed); its completion is :meth:`completed`."""
        i = bucket(ns)
        self.messages += 1
        self.bytes += nbytes
        self.open += 1
        self.posted_ns += ns
        self.posted[i] += 1

    def completed(self, t0: int) -> None:
        """A posted message completed; ``t0``: the ``perf_counter_ns`` of its post (timed), or 0 (not timed)."""
        if t0:
            ns = _clock() - t0
            i = (ns // 1000).bit_length()
            if i > LAST:
                i = LAST
            self.done_ns += ns
            self.done[i] += 1
        self.open -= 1

    def failed(self, exc: BaseException) -> None:
        """A message of this flow failed with ``exc`` (counted by its class, under the flow's peer and path)."""
        REGISTRY.error(self.peer, self.path, exc)

    def read(self) -> dict[str, Any]:
        """A copy of the counts (``timed``: the messages in the histograms' sample; ``completed``: at least 0 --
        messages posted before a :meth:`reset` and still open then are not in ``messages``)."""
        sync, posted, done = list(self.sync), list(self.posted), list(self.done)
        sync_ns = self.sync_ns
        messages, nbytes = self.messages, self.bytes
        for r in list(self.tallies):
            k, b = r.pending()
            messages += k
            nbytes += b
        return {
            "messages": messages,
            "bytes": nbytes,
            "timed": sum(sync) + sum(posted),
            "call_seconds": (sync_ns + self.posted_ns) / 1e9,
            "call_buckets": [a + b for a, b in zip(sync, posted)],
            "completion_seconds": (sync_ns + self.done_ns) / 1e9,
            "completion_buckets": [a + b for a, b in zip(sync, done)],
            "completed": max(0, messages - self.open),
        }


class Registry:
    """Every flow and event of this process (one instance: :data:`REGISTRY`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._flows: dict[tuple[str, str, str], Flow] = {}
        self._negotiations: dict[tuple[str, str], int] = {}
        self._fallbacks: dict[tuple[str, str, str, str], int] = {}
        self._errors: dict[tuple[str, str, str], int] = {}
        self._held: dict[tuple[str, str], list[int]] = {}  # (peer, path) -> [slots, slot bytes, mapped bytes]
        self._ce: dict[str, list[int]] = {}  # peer -> the copy-engine pair's counts (CE_PARTS, in that order)

    def flow(self, peer: int | str, path: str, direction: str) -> Flow:
        """The flow of (``peer``, ``path``, ``direction``), made on first use (``direction``: send or recv)."""
        key = (str(peer), path, direction)
        f = self._flows.get(key)
        if f is None:
            with self._lock:
                f = self._flows.get(key)
                if f is None:
                    f = self._flows[key] = Flow(*key)
        return f

    def negotiated(self, peer: int | str, path: str) -> None:
        """A link (or a backend connection) to ``peer`` was set up on ``path``."""
        key = (str(peer), path)
        with self._lock:
            self._negotiations[key] = self._negotiations.get(key, 0) + 1

    def fell_back(self, peer: int | str, wanted: str, taken: str, reason: str) -> None:
        """Traffic to ``peer`` takes ``taken`` where ``wanted`` was preferred, because of ``reason`` (a short
        snake_case word: it is a label)."""
        key = (str(peer), wanted, taken, reason)
        with self._lock:
            self._fallbacks[key] = self._fallbacks.get(key, 0) + 1

    def error(self, peer: int | str, path: str, exc: BaseException) -> None:
        """An operation with ``peer`` on ``path`` failed with ``exc`` (counted by its class name)."""
        key = (str(peer), path, type(exc).__name__)
        with self._lock:
            self._errors[key] = self._errors.get(key, 0) + 1

    def hold(self, peer: int | str, path: str, *, slots: int = 0, nbytes: int = 0, mapped: int = 0) -> None:
        """Slots (and their bytes) or peer memory mapped for ``peer`` on ``path`` grew by these amounts
        (negative when released)."""
        key = (str(peer), path)
        with self._lock:
            cell = self._held.setdefault(key, [0, 0, 0])
            cell[0] += slots
            cell[1] += nbytes
            cell[2] += mapped

    def ce_counts(self, peer: int | str) -> list[int]:
        """The list a copy-engine pair with ``peer`` counts its messages' parts in (:data:`CE_PARTS`, in order).

        The pair increments it in place (no call per message); :meth:`clear` zeroes it in place.
        """
        key = str(peer)
        with self._lock:
            cell = self._ce.get(key)
            if cell is None:
                cell = self._ce[key] = [0] * len(CE_PARTS)
            return cell

    def snapshot(self) -> dict[str, Any]:
        """Everything, as plain data (see :func:`tensorwire.observe.metrics`)."""
        with self._lock:
            flows = list(self._flows.values())
            negotiations = dict(self._negotiations)
            fallbacks = dict(self._fallbacks)
            errors = dict(self._errors)
            held = {k: list(v) for k, v in self._held.items()}
            ce = {k: list(v) for k, v in self._ce.items()}
        return {
            # (a flow prepared for a path no message took yet -- CUDA tensors of a CPU job -- is left out)
            "flows": [
                {"peer": f.peer, "path": f.path, "direction": f.direction, **r}
                for f in flows
                for r in (f.read(),)
                if r["messages"] or r["completed"]
            ],
            "negotiations": [{"peer": k[0], "path": k[1], "count": n} for k, n in negotiations.items()],
            "fallbacks": [
                {"peer": k[0], "wanted": k[1], "taken": k[2], "reason": k[3], "count": n} for k, n in fallbacks.items()
            ],
            "errors": [{"peer": k[0], "path": k[1], "kind": k[2], "count": n} for k, n in errors.items()],
            "held": [
                {"peer": k[0], "path": k[1], "slots": v[0], "slot_bytes": v[1], "mapped_bytes": v[2]}
                for k, v in held.items()
            ],
            "ce": [{"peer": k, **dict(zip(CE_PARTS, v))} for k, v in ce.items() if any(v)],
        }

    def clear(self) -> None:
        """Zero every count (the flows hooks hold stay registered, at zero)."""
        with self._lock:
            for f in self._flows.values():
                f.reset()
            self._negotiations.clear()
            self._fallbacks.clear()
            self._errors.clear()
            self._held.clear()
            for cell in self._ce.values():
                cell[:] = [0] * len(cell)


REGISTRY = Registry()


class _Switch:
    """Whether hooks count, and one message in how many they time (read on every message: attributes of one
    object)."""

    __slots__ = ("on", "every", "_read")

    def __init__(self) -> None:
        self.on = True
        self.every = 16
        self._read = False

    def load(self) -> bool:
        if not self._read:
            self.on = bool(setting("metrics"))
            self.every = int(setting("metrics_sample"))
            self._read = True
        return self.on


SWITCH = _Switch()


def enabled() -> bool:
    """Whether counting is on (``TENSORWIRE_METRICS``, read once, unless :func:`set_enabled` said otherwise)."""
    return SWITCH.load()


def set_enabled(on: bool) -> None:
    """Turn counting on or off for this process from now on (what was counted stays)."""
    SWITCH.load()
    SWITCH.on = bool(on)


def sample_every() -> int:
    """One message in how many of each route is timed (``TENSORWIRE_METRICS_SAMPLE``, unless
    :func:`set_sample_every` said otherwise)."""
    SWITCH.load()
    return SWITCH.every


def set_sample_every(n: int) -> None:
    """Time one message in ``n`` of each route from each route's next timed message on (1: every message)."""
    if int(n) < 1:
        raise ValueError(f"one message in n is timed: n must be >= 1, not {n}")
    SWITCH.load()
    SWITCH.every = int(n)
