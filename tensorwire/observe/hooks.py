"""What links and the torch.distributed backend call on each public operation: counts and profiler ranges.

One object per link (:class:`LinkWatch`) and one per process group
(:class:`GroupWatch`) sits between the public method and the work it does:

- with counting on (:mod:`.registry`) and no profiler, a call costs a few
  additions to its flow, and one call in ``TENSORWIRE_METRICS_SAMPLE`` of each
  route (16 unless set) two clock readings and a bucket more: it is timed
  (``bench/bench_observe_cost.py`` measures it against counting off);
- while a ``torch.profiler`` session records, each call also runs inside a
  ``record_function`` range named with the operation, the peer, the tag (or the
  tensor's name), the bytes and the path, e.g.
  ``tensorwire.send peer=1 tag=0 bytes=4096 path=tcp``; a CUDA operation's range
  covers the copies it queues, so the trace lines them up with the kernels.
  Outside a profiler session no range is made: ``record_function`` costs
  microseconds even then, so the profiler's own flag is checked first.

The path of a message is prepared once per name (links) or per peer (the
backend): the transport's kind, ``staged`` for CUDA tensors over a transport
that cannot reach device memory, ``cma`` for the messages a TCP link with
cross-memory attach sends that way. A layer with a path of its own (the
copy-engine path, ``ce``) relabels it (:meth:`GroupWatch.set_path`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tensorwire.observe.registry import REGISTRY, SWITCH, Flow

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.spec import TensorSpec
    from tensorwire.transport.base import Transport

__all__ = [
    "LinkWatch",
    "GroupWatch",
    "Route",
    "profiling",
    "profiler_flag",
    "traced",
    "traced_wait",
    "transport_path",
    "cuda_path",
]

_clock = time.perf_counter_ns


def profiler_flag() -> Callable[[], bool]:
    """torch's own "a profiler records" function (call it per operation: tens of ns; loads torch)."""
    return _profiler_enabled()


def profiling() -> bool:
    """Whether a ``torch.profiler`` / autograd profiler session is recording in this process."""
    return bool(_profiler_enabled()())


def _profiler_enabled() -> Callable[[], bool]:
    """torch's own flag of a recording profiler (a C function: tens of ns), looked up once torch is loaded."""
    fn = _PROFILER[0]
    if fn is None:
        import torch

        fn = _PROFILER[0] = torch._C._autograd._profiler_enabled
    return fn


_PROFILER: list[Callable[[], bool] | None] = [None]


def traced(label: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` inside a profiler range named ``label``."""
    from torch.autograd.profiler import record_function

    with record_function(label):
        return fn(*args)


def transport_path(transport: "Transport") -> str:
    """The path label of host tensors over ``transport``."""
    return str(getattr(transport, "kind", "?"))


def cuda_path(transport: "Transport") -> str:
    """The path label of CUDA tensors over ``transport``: its kind where it reaches device memory, else staged."""
    return transport_path(transport) if getattr(transport, "reaches_cuda", False) else "staged"


class Route:
    """Where the messages of one name (a link) or one peer and device type (the backend) are counted.

    ``nbytes``: the bytes of every message (static specs), or None (read from the tensor). ``cma``: the
    transport's cross-memory-attach state, when it has one: messages of at least its ``min_bytes`` that it
    sends that way count under ``cma``. ``due``: messages until the next timed one (1: the next), counted down
    by the hooks (the route's messages are timed one in ``SWITCH.every``; a race of two threads on one route
    can time one message more or fewer).

    ``fixed``: every message of the route has ``nbytes`` bytes and goes to ``flow`` (a static spec below cma's
    threshold: a Link's usual route). Its untimed messages are counted by the countdown alone: ``batch - due``
    of them are the route's since its last timed message, which adds them into the flow (the flow's reads add
    a fixed route's share still on it: :meth:`pending`). One decrement per message instead of a decrement and
    two additions: in a 4 KiB ping-pong on a 2-core VM the additions were most of what counting cost
    (``bench/bench_observe_cost.py``).
    """

    __slots__ = (
        "peer",
        "path",
        "direction",
        "flow",
        "nbytes",
        "cma",
        "cma_min",
        "cma_flow",
        "fallback_due",
        "due",
        "batch",
        "fixed",
    )

    def __init__(self, peer: int, path: str, direction: str, *, nbytes: int | None = None, cma: Any = None) -> None:
        self.peer = peer
        self.path = path
        self.direction = direction
        self.flow = REGISTRY.flow(peer, path, direction)
        self.nbytes = nbytes
        self.cma = cma if path == "tcp" else None
        #: below this many bytes a message never goes by cma (the transport's threshold, fixed when it is made; a
        #: route without cma: never): the hooks take ``flow`` then, without calling :meth:`flow_for`
        self.cma_min = int(self.cma.min_bytes) if self.cma is not None else 1 << 62
        self.cma_flow: Flow | None = None  # made by the first message that goes by cma
        self.fallback_due = path == "staged"  # a staged route of the backend: its fallback is still to be counted
        self.due = self.batch = 1  # the first message is timed
        self.fixed = nbytes is not None and nbytes < self.cma_min
        if self.fixed:
            self.flow.tally(self)

    def pending(self) -> tuple[int, int]:
        """(messages, bytes) of a fixed route counted by its countdown and not added into its flow yet."""
        k = self.batch - self.due
        return k, k * (self.nbytes or 0)

    def settle(self) -> None:
        """A timed message of a fixed route is due: add its untimed messages into the flow and restart the
        countdown (``SWITCH.every`` messages to the next timed one). The reads, the reset and the additions have
        no call between them, so no thread of this process sees them half done (CPython hands its lock to
        another thread only at calls and backward jumps)."""
        k = self.batch - self.due
        self.batch = self.due = SWITCH.every
        f = self.flow
        f.messages += k
        f.bytes += k * (self.nbytes or 0)

    def forget(self) -> None:
        """The counts were reset: the untimed messages on this route are dropped with them."""
        self.batch = self.due

    def flow_for(self, nbytes: int) -> Flow:
        cma = self.cma
        if cma is not None and nbytes >= self.cma_min and (self.direction == "recv" or cma.sending):
            f = self.cma_flow
            if f is None:
                f = self.cma_flow = REGISTRY.flow(self.peer, "cma", self.direction)
            return f
        return self.flow

    def path_for(self, nbytes: int) -> str:
        return self.flow_for(nbytes).path

    def failed(self, exc: BaseException) -> None:
        """An operation of this route failed (counted by the error's class)."""
        REGISTRY.error(self.peer, self.path, exc)


def _nbytes(tensor: Any) -> int:
    return int(tensor.nbytes) if tensor is not None else 0


class LinkWatch:
    """The hooks of one :class:`~tensorwire.p2p.link.Link`: ``send``, ``recv`` and ``isend`` go through here.

    Args:
        peer: the peer's rank.
        transport: the link's data connection.
        send, recv: the link's specs by name.
        do_send(name, tensor, timeout), do_recv(name, out, timeout), do_isend(name, tensor, timeout): the
            link's own operations.
        paths: path labels by name, over the prepared ones (a layer with a path of its own).
    """

    def __init__(
        self,
        peer: int,
        transport: "Transport",
        *,
        send: "Mapping[str, TensorSpec]",
        recv: "Mapping[str, TensorSpec]",
        do_send: Callable[[str, Any, float | None], None],
        do_recv: Callable[[str, Any, float | None], Any],
        do_isend: Callable[[str, Any, float | None], Any],
        paths: Mapping[str, str] | None = None,
    ) -> None:
        self.peer = peer
        self._do_send = do_send
        self._do_recv = do_recv
        self._do_isend = do_isend
        cma = getattr(transport, "cma", None)
        paths = paths or {}

        def route(spec: "TensorSpec", direction: str) -> Route:
            path = paths.get(spec.name) or (
                cuda_path(transport) if spec.device == "cuda" else transport_path(transport)
            )
            return Route(peer, path, direction, nbytes=None if spec.is_dynamic else spec.nbytes, cma=cma)

        self._send = {n: route(s, "send") for n, s in send.items()}
        self._recv = {n: route(s, "recv") for n, s in recv.items()}
        if any(r.path == "staged" for r in [*self._send.values(), *self._recv.values()]):
            REGISTRY.fell_back(peer, "ucx", "staged", f"{transport_path(transport)}_cannot_reach_cuda")
        self._prof = _profiler_enabled()
        self._held: list[tuple[str, int, int]] = []
        SWITCH.load()  # (TENSORWIRE_METRICS and TENSORWIRE_METRICS_SAMPLE, read once per process)

    def hold(self, slots: "list[Any]") -> None:
        """Count the link's slots as held (by the path of the link's transport), until :meth:`release`."""
        path = next(iter(self._send.values() or self._recv.values()), None)
        label = path.path if path is not None else "?"
        total = sum(int(getattr(s, "nbytes", 0)) for s in slots)
        REGISTRY.hold(self.peer, label, slots=len(slots), nbytes=total)
        self._held.append((label, len(slots), total))

    def release(self) -> None:
        """The link closed: its slots are no longer held, its fixed routes' counts go into their flows."""
        held, self._held = self._held, []
        for label, n, total in held:
            REGISTRY.hold(self.peer, label, slots=-n, nbytes=-total)
        for r in [*self._send.values(), *self._recv.values()]:
            if r.fixed:
                r.flow.untally(r)

    # send and recv: the whole cost of a counted message that is not timed is inline below -- a countdown (a
    # fixed route: Route's docstring), or a countdown and two additions, no call of ours below cma's threshold;
    # a timed one (one in SWITCH.every) goes through _timed: two clock readings and a bucket more
    # (bench/bench_observe_cost.py)
    def send(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> None:
        if self._prof():
            return self._traced("send", self._send, self._do_send, name, tensor, timeout)
        r = self._send.get(name)
        if r is None or not SWITCH.on:
            return self._do_send(name, tensor, timeout)
        due = r.due - 1
        if not due:
            return self._timed("send", r, self._do_send, name, tensor, timeout)
        r.due = due
        try:
            self._do_send(name, tensor, timeout)
        except BaseException as exc:
            self._failed(r, exc)
            raise
        if r.fixed:  # counted by the countdown
            return
        n = r.nbytes
        if n is None:
            n = _nbytes(tensor)
        f = r.flow if n < r.cma_min else r.flow_for(n)
        f.messages += 1
        f.bytes += n

    def recv(self, name: str, out: "torch.Tensor | None", timeout: float | None) -> "torch.Tensor":
        if self._prof():
            return self._traced("recv", self._recv, self._do_recv, name, out, timeout)
        r = self._recv.get(name)
        if r is None or not SWITCH.on:
            return self._do_recv(name, out, timeout)
        due = r.due - 1
        if not due:
            return self._timed("recv", r, self._do_recv, name, out, timeout)
        r.due = due
        try:
            got = self._do_recv(name, out, timeout)
        except BaseException as exc:
            self._failed(r, exc)
            raise
        if r.fixed:  # counted by the countdown
            return got
        n = r.nbytes
        if n is None:
            n = _nbytes(got)
        f = r.flow if n < r.cma_min else r.flow_for(n)
        f.messages += 1
        f.bytes += n
        return got

    def isend(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> Any:
        if self._prof():
            return self._traced("isend", self._send, self._do_isend, name, tensor, timeout)
        r = self._send.get(name)
        if r is None or not SWITCH.on:
            return self._do_isend(name, tensor, timeout)
        due = r.due - 1
        if not due:
            return self._timed("isend", r, self._do_isend, name, tensor, timeout)
        r.due = due
        try:
            handle = self._do_isend(name, tensor, timeout)
        except BaseException as exc:
            self._failed(r, exc)
            raise
        if r.fixed:  # counted by the countdown
            f = r.flow
        else:
            n = r.nbytes if r.nbytes is not None else _nbytes(tensor)
            f = r.flow_for(n)
            f.messages += 1
            f.bytes += n
        f.open += 1
        handle.watch(f, 0)
        return handle

    def _failed(self, r: Route, exc: BaseException) -> None:
        """An untimed message of ``r`` failed: counted as an error, not as a message."""
        if r.fixed:
            r.due += 1  # (the countdown had counted it)
        r.failed(exc)

    def _timed(self, op: str, r: Route, fn: Callable[..., Any], name: str, t: Any, timeout: Any) -> Any:
        """``op`` (send, recv, isend) of ``name`` through ``fn``, counted and timed (the route's next timed
        message is ``SWITCH.every`` on; a fixed route's untimed messages go into its flow first)."""
        if r.fixed:
            r.settle()
        else:
            r.due = SWITCH.every
        t0 = _clock()
        try:
            got = fn(name, t, timeout)
        except BaseException as exc:
            r.failed(exc)
            raise
        ns = _clock() - t0
        n = r.nbytes
        if n is None:
            n = _nbytes(got if op == "recv" else t)
        f = r.flow_for(n)
        if op == "isend":
            f.post(n, ns)
            got.watch(f, t0)
        else:
            f.called(n, ns)
        return got

    def _traced(
        self, op: str, routes: dict[str, Route], fn: Callable[..., Any], name: str, t: Any, timeout: Any
    ) -> Any:
        """``op`` inside a profiler range (a profiler records; every message is timed then)."""
        r = routes.get(name)
        if r is None:
            return traced(f"tensorwire.link.{op} {name} peer={self.peer}", fn, name, t, timeout)
        n = r.nbytes if r.nbytes is not None else _nbytes(t)
        label = f"tensorwire.link.{op} {name} peer={self.peer} bytes={n} path={r.path_for(n)}"
        if not SWITCH.on:
            return traced(label, fn, name, t, timeout)
        from torch.autograd.profiler import record_function

        with record_function(label):
            return self._timed(op, r, fn, name, t, timeout)


class GroupWatch:
    """The hooks of one ``backend="tensorwire"`` process group: ``send`` and ``recv`` (which ``isend``, ``irecv``,
    ``batch_isend_irecv`` and everything on top call) go through here; so does ``Work.wait`` (:func:`traced_wait`).

    Args:
        peers: the data connection to each other rank.
        do_send(tensors, dst, tag) -> Work, do_recv(tensors, src, tag) -> Work: the group's own operations
            (a :class:`tensorwire.distributed.work.Work`: the hooks read its ``_is_done`` and ``_exc``).
        cuda: whether a tensor can be a CUDA one in this process (False: the hooks do not ask a tensor).
    """

    def __init__(
        self,
        peers: "Mapping[int, Transport]",
        *,
        do_send: Callable[[list[Any], int, int], Any],
        do_recv: Callable[[list[Any], int, int], Any],
        cuda: bool = True,
    ) -> None:
        self._do_send = do_send
        self._do_recv = do_recv
        self._cuda = cuda
        self._prof = _profiler_enabled()
        SWITCH.load()  # (TENSORWIRE_METRICS and TENSORWIRE_METRICS_SAMPLE, read once per process)
        # peer -> route, per direction: of host tensors and of CUDA tensors (the hooks look up the host one first:
        # in a process without CUDA it is the only one asked for)
        self._host: dict[str, dict[int, Route]] = {"send": {}, "recv": {}}
        self._dev: dict[str, dict[int, Route]] = {"send": {}, "recv": {}}
        self._hsend, self._hrecv = self._host["send"], self._host["recv"]
        self._dsend, self._drecv = self._dev["send"], self._dev["recv"]
        for peer, t in peers.items():
            cma = getattr(t, "cma", None)
            for d in ("send", "recv"):
                self._host[d][peer] = Route(peer, transport_path(t), d, cma=cma)
                self._dev[d][peer] = Route(peer, cuda_path(t), d)

    def set_path(self, peer: int, *, cuda: str | None = None, host: str | None = None) -> None:
        """Count the CUDA (or host) tensors to and from ``peer`` under ``cuda`` (or ``host``) from now on (e.g.
        ``cuda="ce"`` once the copy-engine path to that peer is set up)."""
        for d in ("send", "recv"):
            if host is not None:
                self._host[d][peer] = Route(peer, host, d)
            if cuda is not None:
                self._dev[d][peer] = Route(peer, cuda, d)

    # send and recv: the same code, inline -- what follows is the whole cost of a counted message that is not
    # timed (a countdown, a few additions), with no call of ours below cma's threshold; a timed one (one in
    # SWITCH.every) goes through _timed (bench/bench_observe_cost.py measures it against counting off)
    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        """``send`` of the group, counted (and in a profiler range while one records)."""
        if self._prof():
            return self._traced("send", self._do_send, tensors, dst, tag)
        if not SWITCH.on:
            return self._do_send(tensors, dst, tag)
        try:
            r = self._hsend[dst]
            (t,) = tensors
        except (KeyError, TypeError, ValueError):
            return self._do_send(tensors, dst, tag)  # (raises: not a peer, not one tensor)
        if self._cuda and t.is_cuda:
            r = self._device_route("send", dst)
        n = t.nbytes
        due = r.due - 1
        if not due:
            return self._timed(r, self._do_send, tensors, dst, tag, n)
        r.due = due
        try:
            work = self._do_send(tensors, dst, tag)
        except BaseException as exc:
            r.failed(exc)
            raise
        f = r.flow if n < r.cma_min else r.flow_for(n)
        f.messages += 1
        f.bytes += n
        if work._is_done:  # completed in the call (most host sends)
            if work._exc is not None:
                r.failed(work._exc)
        else:  # completes later: counted then (Work.watch inline, untimed: see its docstring)
            f.open += 1
            work._flow = f  # (a failure is counted by the flow: Work._finish)
            if work._is_done:
                work._watched_late(f)
        return work

    def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
        """``recv`` of the group, counted (and in a profiler range while one records)."""
        if self._prof():
            return self._traced("recv", self._do_recv, tensors, src, tag)
        if not SWITCH.on:
            return self._do_recv(tensors, src, tag)
        try:
            r = self._hrecv[src]
            (t,) = tensors
        except (KeyError, TypeError, ValueError):
            return self._do_recv(tensors, src, tag)  # (raises: not a peer, not one tensor)
        if self._cuda and t.is_cuda:
            r = self._device_route("recv", src)
        n = t.nbytes
        due = r.due - 1
        if not due:
            return self._timed(r, self._do_recv, tensors, src, tag, n)
        r.due = due
        try:
            work = self._do_recv(tensors, src, tag)
        except BaseException as exc:
            r.failed(exc)
            raise
        f = r.flow if n < r.cma_min else r.flow_for(n)
        f.messages += 1
        f.bytes += n
        if work._is_done:  # completed in the call (most host sends)
            if work._exc is not None:
                r.failed(work._exc)
        else:  # completes later: counted then (Work.watch inline, untimed: see its docstring)
            f.open += 1
            work._flow = f  # (a failure is counted by the flow: Work._finish)
            if work._is_done:
                work._watched_late(f)
        return work

    def _device_route(self, direction: str, peer: int) -> Route:
        """The route of a CUDA tensor to or from ``peer`` (a staged one counts its fallback once)."""
        r = self._dev[direction][peer]
        if r.fallback_due:
            r.fallback_due = False
            REGISTRY.fell_back(peer, "ucx", "staged", f"{self._host[direction][peer].path}_cannot_reach_cuda")
        return r

    @staticmethod
    def _timed(
        r: Route, fn: Callable[[list[Any], int, int], Any], tensors: list[Any], peer: int, tag: int, n: int
    ) -> Any:
        """``fn(tensors, peer, tag)`` (a message of ``n`` bytes), counted and timed (the route's next timed
        message is ``SWITCH.every`` on)."""
        r.due = SWITCH.every
        t0 = _clock()
        try:
            work = fn(tensors, peer, tag)
        except BaseException as exc:
            r.failed(exc)
            raise
        ns = _clock() - t0
        f = r.flow_for(n)
        if work._is_done:  # a blocking call: its call time is its time to completion
            f.called(n, ns)
            if work._exc is not None:
                r.failed(work._exc)
        else:
            f.post(n, ns)
            work.watch(f, t0)
        return work

    def _traced(
        self, direction: str, fn: Callable[[list[Any], int, int], Any], tensors: list[Any], peer: int, tag: int
    ) -> Any:
        """:meth:`send` / :meth:`recv` inside a profiler range (a profiler records; every message is timed)."""
        from torch.autograd.profiler import record_function

        host = self._host[direction].get(peer)
        if host is None or len(tensors) != 1:
            return traced(f"tensorwire.{direction} peer={peer} tag={tag}", fn, tensors, peer, tag)
        t = tensors[0]
        r = self._device_route(direction, peer) if t.is_cuda else host
        n = int(t.nbytes)
        with record_function(f"tensorwire.{direction} peer={peer} tag={tag} bytes={n} path={r.path_for(n)}"):
            if not SWITCH.on:
                return fn(tensors, peer, tag)
            return self._timed(r, fn, tensors, peer, tag, n)


def traced_wait(wait: Callable[[Any], bool], describe: Callable[[], str], timeout: Any) -> bool:
    """``wait(timeout)`` inside a profiler range ``tensorwire.wait <what the work is>`` (called only while a
    profiler records: see :func:`profiling`)."""
    from torch.autograd.profiler import record_function

    with record_function(f"tensorwire.wait {describe()}"):
        return wait(timeout)
