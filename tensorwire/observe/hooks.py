"""What links and the torch.distributed backend call on each public operation: counts and profiler ranges.

One object per link (:class:`LinkWatch`) and one per process group
(:class:`GroupWatch`) sits between the public method and the work it does:

- with counting on (:mod:`.registry`) and no profiler, a call costs two clock
  readings and one locked update of its flow (``bench/bench_observe.py``
  measures it against counting off);
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

from tensorwire.observe.registry import LAST, REGISTRY, SWITCH, Flow

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
    sends that way count under ``cma``.
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
        "on_error",
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
        self.on_error = self.failed  # (bound once: a work keeps it)

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

    def hold(self, slots: "list[Any]") -> None:
        """Count the link's slots as held (by the path of the link's transport), until :meth:`release`."""
        path = next(iter(self._send.values() or self._recv.values()), None)
        label = path.path if path is not None else "?"
        total = sum(int(getattr(s, "nbytes", 0)) for s in slots)
        REGISTRY.hold(self.peer, label, slots=len(slots), nbytes=total)
        self._held.append((label, len(slots), total))

    def release(self) -> None:
        """The link closed: its slots are no longer held."""
        held, self._held = self._held, []
        for label, n, total in held:
            REGISTRY.hold(self.peer, label, slots=-n, nbytes=-total)

    # send and recv: the whole cost of a counted message is inline below -- two clock readings, one bucket, three
    # additions; no call of ours below cma's threshold (bench/bench_observe_cost.py)
    def send(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> None:
        if self._prof():
            return self._traced("send", self._send, self._do_send, name, tensor, timeout)
        r = self._send.get(name)
        if r is None or not SWITCH.on:
            return self._do_send(name, tensor, timeout)
        t0 = _clock()
        try:
            self._do_send(name, tensor, timeout)
        except BaseException as exc:
            REGISTRY.error(self.peer, r.path, exc)
            raise
        ns = _clock() - t0
        n = r.nbytes
        if n is None:
            n = _nbytes(tensor)
        f = r.flow if n < r.cma_min else r.flow_for(n)
        i = (ns // 1000).bit_length()
        if i > LAST:
            i = LAST
        # Flow.called inline (a method call costs as much as the update)
        f.bytes += n
        f.sync_ns += ns
        f.sync[i] += 1

    def recv(self, name: str, out: "torch.Tensor | None", timeout: float | None) -> "torch.Tensor":
        if self._prof():
            return self._traced("recv", self._recv, self._do_recv, name, out, timeout)
        r = self._recv.get(name)
        if r is None or not SWITCH.on:
            return self._do_recv(name, out, timeout)
        t0 = _clock()
        try:
            got = self._do_recv(name, out, timeout)
        except BaseException as exc:
            REGISTRY.error(self.peer, r.path, exc)
            raise
        ns = _clock() - t0
        n = r.nbytes
        if n is None:
            n = _nbytes(got)
        f = r.flow if n < r.cma_min else r.flow_for(n)
        i = (ns // 1000).bit_length()
        if i > LAST:
            i = LAST
        f.bytes += n
        f.sync_ns += ns
        f.sync[i] += 1
        return got

    def isend(self, name: str, tensor: "torch.Tensor", timeout: float | None) -> Any:
        if self._prof():
            return self._traced("isend", self._send, self._do_isend, name, tensor, timeout)
        r = self._send.get(name)
        if r is None or not SWITCH.on:
            return self._do_isend(name, tensor, timeout)
        return self._isend(r, name, tensor, timeout)

    def _isend(self, r: Route, name: str, tensor: Any, timeout: float | None) -> Any:
        t0 = _clock()
        try:
            handle = self._do_isend(name, tensor, timeout)
        except BaseException as exc:
            REGISTRY.error(self.peer, r.path, exc)
            raise
        n = r.nbytes if r.nbytes is not None else _nbytes(tensor)
        flow = r.flow_for(n)
        flow.post(n, _clock() - t0)
        handle.watch(flow, t0)
        return handle

    def _traced(
        self, op: str, routes: dict[str, Route], fn: Callable[..., Any], name: str, t: Any, timeout: Any
    ) -> Any:
        r = routes.get(name)
        if r is None:
            return traced(f"tensorwire.link.{op} {name} peer={self.peer}", fn, name, t, timeout)
        n = r.nbytes if r.nbytes is not None else _nbytes(t)
        label = f"tensorwire.link.{op} {name} peer={self.peer} bytes={n} path={r.path_for(n)}"
        if not SWITCH.on:
            return traced(label, fn, name, t, timeout)
        from torch.autograd.profiler import record_function

        with record_function(label):
            if op == "isend":
                return self._isend(r, name, t, timeout)
            t0 = _clock()
            try:
                got = fn(name, t, timeout)
            except BaseException as exc:
                REGISTRY.error(self.peer, r.path, exc)
                raise
            if r.nbytes is None and op == "recv":
                n = _nbytes(got)
            r.flow_for(n).called(n, _clock() - t0)
            return got


class GroupWatch:
    """The hooks of one ``backend="tensorwire"`` process group: ``send`` and ``recv`` (which ``isend``, ``irecv``,
    ``batch_isend_irecv`` and everything on top call) go through here; so does ``Work.wait`` (:func:`traced_wait`).

    Args:
        peers: the data connection to each other rank.
        do_send(tensors, dst, tag) -> Work, do_recv(tensors, src, tag) -> Work: the group's own operations.
    """

    def __init__(
        self,
        peers: "Mapping[int, Transport]",
        *,
        do_send: Callable[[list[Any], int, int], Any],
        do_recv: Callable[[list[Any], int, int], Any],
    ) -> None:
        self._do_send = do_send
        self._do_recv = do_recv
        self._prof = _profiler_enabled()
        # peer -> (host route, CUDA route), one dict per direction
        self._sends: dict[int, tuple[Route, Route]] = {}
        self._recvs: dict[int, tuple[Route, Route]] = {}
        self._routes: dict[str, dict[int, tuple[Route, Route]]] = {"send": self._sends, "recv": self._recvs}
        for peer, t in peers.items():
            cma = getattr(t, "cma", None)
            for d, routes in self._routes.items():
                routes[peer] = (Route(peer, transport_path(t), d, cma=cma), Route(peer, cuda_path(t), d))

    def set_path(self, peer: int, *, cuda: str | None = None, host: str | None = None) -> None:
        """Count the CUDA (or host) tensors to and from ``peer`` under ``cuda`` (or ``host``) from now on (e.g.
        ``cuda="ce"`` once the copy-engine path to that peer is set up)."""
        for d, routes in self._routes.items():
            h, c = routes[peer]
            routes[peer] = (h if host is None else Route(peer, host, d), c if cuda is None else Route(peer, cuda, d))

    # send and recv: the same code, inline -- what follows is a counted message's whole cost, with no call of
    # ours below cma's threshold (bench/bench_observe_cost.py measures it against counting off)
    def send(self, tensors: list[Any], dst: int, tag: int) -> Any:
        """``send`` of the group, counted (and in a profiler range while one records)."""
        if self._prof():
            return self._traced("send", self._do_send, tensors, dst, tag)
        if not SWITCH.on:
            return self._do_send(tensors, dst, tag)
        routes = self._sends.get(dst)
        if routes is None or len(tensors) != 1:
            return self._do_send(tensors, dst, tag)  # (raises: not a peer, not one tensor)
        t = tensors[0]
        r = routes[1] if t.is_cuda else routes[0]
        if r.fallback_due:  # (staged CUDA tensors: the fallback is counted once)
            self._note_staged(r, routes[0].path)
        n = t.nbytes
        t0 = _clock()
        try:
            work = self._do_send(tensors, dst, tag)
        except BaseException as exc:
            r.failed(exc)
            raise
        ns = _clock() - t0
        f = r.flow if n < r.cma_min else r.flow_for(n)
        i = (ns // 1000).bit_length()
        if i > LAST:
            i = LAST
        f.bytes += n
        if work.watch(f, t0, r.on_error):  # completes later: its completion is counted then
            f.posted_ns += ns
            f.posted[i] += 1
        else:  # completed in the call (most host sends): a blocking call
            f.sync_ns += ns
            f.sync[i] += 1
        return work

    def recv(self, tensors: list[Any], src: int, tag: int) -> Any:
        """``recv`` of the group, counted (and in a profiler range while one records)."""
        if self._prof():
            return self._traced("recv", self._do_recv, tensors, src, tag)
        if not SWITCH.on:
            return self._do_recv(tensors, src, tag)
        routes = self._recvs.get(src)
        if routes is None or len(tensors) != 1:
            return self._do_recv(tensors, src, tag)  # (raises: not a peer, not one tensor)
        t = tensors[0]
        r = routes[1] if t.is_cuda else routes[0]
        if r.fallback_due:  # (staged CUDA tensors: the fallback is counted once)
            self._note_staged(r, routes[0].path)
        n = t.nbytes
        t0 = _clock()
        try:
            work = self._do_recv(tensors, src, tag)
        except BaseException as exc:
            r.failed(exc)
            raise
        ns = _clock() - t0
        f = r.flow if n < r.cma_min else r.flow_for(n)
        i = (ns // 1000).bit_length()
        if i > LAST:
            i = LAST
        f.bytes += n
        if work.watch(f, t0, r.on_error):  # completes later: its completion is counted then
            f.posted_ns += ns
            f.posted[i] += 1
        else:  # completed in the call (most host sends): a blocking call
            f.sync_ns += ns
            f.sync[i] += 1
        return work

    @staticmethod
    def _note_staged(r: Route, host_path: str) -> None:
        r.fallback_due = False
        REGISTRY.fell_back(r.peer, "ucx", "staged", f"{host_path}_cannot_reach_cuda")

    def _traced(
        self, direction: str, fn: Callable[[list[Any], int, int], Any], tensors: list[Any], peer: int, tag: int
    ) -> Any:
        """:meth:`send` / :meth:`recv` inside a profiler range (a profiler records)."""
        from torch.autograd.profiler import record_function

        routes = self._routes[direction].get(peer)
        if routes is None or len(tensors) != 1:
            return traced(f"tensorwire.{direction} peer={peer} tag={tag}", fn, tensors, peer, tag)
        t = tensors[0]
        r = routes[1] if t.is_cuda else routes[0]
        n = int(t.nbytes)
        with record_function(f"tensorwire.{direction} peer={peer} tag={tag} bytes={n} path={r.path_for(n)}"):
            if not SWITCH.on:
                return fn(tensors, peer, tag)
            if r.fallback_due:
                self._note_staged(r, routes[0].path)
            t0 = _clock()
            try:
                work = fn(tensors, peer, tag)
            except BaseException as exc:
                r.failed(exc)
                raise
            f = r.flow_for(n)
            ns = _clock() - t0
            if work.watch(f, t0, r.on_error):
                f.post(n, ns)
            else:
                f.called(n, ns)
            return work


def traced_wait(wait: Callable[[Any], bool], describe: Callable[[], str], timeout: Any) -> bool:
    """``wait(timeout)`` inside a profiler range ``tensorwire.wait <what the work is>`` (called only while a
    profiler records: see :func:`profiling`)."""
    from torch.autograd.profiler import record_function

    with record_function(f"tensorwire.wait {describe()}"):
        return wait(timeout)
