"""``Node`` (one per process) and ``Link`` (a negotiated channel to one peer).

A :class:`Node` owns the process's control server, its data-plane listeners
and its handle on the bootstrap store. :meth:`Node.link` negotiates a
:class:`Link` with a peer rank: both sides declare what they send and what they
expect to receive, the declarations are checked against each other (a
difference fails on both sides with :class:`~tensorwire.ShapeMismatchError`),
a transport is chosen, the data connection is made, and every slot is
allocated — once.

On the hot path (:meth:`Link.send` / :meth:`Link.recv`) nothing is allocated
(beyond small Python objects), nothing is serialized, and no gRPC call is made.

Receive slots are double-buffered: :meth:`Link.recv` returns the slot tensor,
valid until the next ``recv`` of that name, while the other buffer is already
posted for the next message. So a peer can send message *k+1* while this side
still holds message *k*, and two ranks that each ``send`` then ``recv`` every
step never deadlock. ``Node.link(..., depth=)`` gives a name more slots: with
``depth`` *d* a received slot stays valid until *d - 1* more ``recv`` calls of
that name (a GPipe stage keeps every microbatch's activation in its own slot
through the backward pass, with no copy), and the slots are re-posted in the
order they were received in.

Transport choice (both sides compute the same answer from both offers):

- ``tcp`` or ``ucx`` asked on either side wins (asked on both and different: error);
- ``auto``: UCX when both sides have it **and** it beats a socket: the peer
  shares this machine and IPC namespace (:func:`host_id`: UCX then uses shared
  memory for small messages and cma / cuda_ipc single-copy rendezvous for large
  ones), the link has CUDA specs (zero-copy GPU memory: cuda_ipc / GPUDirect),
  or there is an RDMA network device; TCP otherwise -- between hosts without
  RDMA, UCX runs over TCP too and a plain socket was measured faster (see
  ``bench/results/``). ``TENSORWIRE_AUTO_PREFER=ucx`` / ``=tcp`` puts that
  transport first under auto.
  If UCX is chosen but cannot connect, the link falls back to TCP with a WARNING.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Sequence

from .buffers import Slot, as_bytes, cuda_available
from .gpu import current_stream_idle, sync_current_stream
from .errors import (
    ClosedError,
    ConfigError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    ShapeMismatchError,
    TensorWireError,
    TransferTimeout,
    TransportError,
)
from .spec import TensorSpec, check_same_specs
from .transport.base import Listener, Transport, get_factory, new_nonce

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .v1 import control_pb2

__all__ = ["Node", "Link", "SendHandle", "TransportChoice", "choose_transport"]

log = logging.getLogger(__name__)

TransportChoice = Literal["auto", "ucx", "tcp"]
_CHOICES = ("auto", "ucx", "tcp")
DEFAULT_TIMEOUT = 60.0
DEFAULT_PEER_TIMEOUT = 30.0


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ConfigError(f"{name}={raw!r} must be > 0")
    return value


def _check_choice(transport: str, *, source: str) -> TransportChoice:
    if transport not in _CHOICES:
        raise ConfigError(f"{source}: transport must be one of {', '.join(_CHOICES)}, got {transport!r}")
    return transport  # type: ignore[return-value]


def ucx_has_rdma() -> bool:
    """Whether UCX here sees an RDMA device (InfiniBand/RoCE). Cheap check of /sys."""
    try:
        return any(os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Who can share memory with whom: a hash of the kernel boot id and this process's IPC namespace.

    Two processes with the same value run on one machine in one IPC namespace,
    where UCX reaches the peer through shared memory, cma (one copy between
    address spaces) and cuda_ipc -- faster than any socket. Network namespaces
    (and containers started with ``--ipc=host``) share it; separate pods do not.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    try:
        parts.append(str(os.stat("/proc/self/ns/ipc").st_ino))
    except OSError:
        parts.append("")
    if not any(parts):
        return ""  # unknown: never claims to share a host
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def auto_preference(env: "Mapping[str, str] | None" = None) -> str:
    """``TENSORWIRE_AUTO_PREFER``: "" (follow the rule), "ucx" or "tcp" (that transport first under auto).

    Raises:
        ConfigError: any other value.
    """
    raw = (os.environ if env is None else env).get("TENSORWIRE_AUTO_PREFER", "")
    pref = raw.strip().lower()
    if pref not in ("", "ucx", "tcp"):
        raise ConfigError(f"TENSORWIRE_AUTO_PREFER={raw!r}: must be 'ucx', 'tcp' or unset")
    return pref


def same_host(mine: "control_pb2.LinkOffer", theirs: "control_pb2.LinkOffer") -> bool:
    return bool(mine.host_id) and mine.host_id == theirs.host_id


def choose_transport(mine: "control_pb2.LinkOffer", theirs: "control_pb2.LinkOffer", *, needs_cuda: bool) -> list[str]:
    """Transports to try, in order, for a link between two offers (symmetric).

    Raises:
        ConfigError: the two sides insist on different transports, or one
            insists on a transport the other cannot use.
    """
    kinds_a = [d.kind for d in mine.data]
    kinds_b = [d.kind for d in theirs.data]
    common = [k for k in kinds_a if k in kinds_b]
    asked = {mine.transport, theirs.transport} - {"auto"}
    if len(asked) > 1:
        raise ConfigError(f"the two sides ask for different transports: {mine.transport!r} and {theirs.transport!r}")
    if asked:
        kind = asked.pop()
        if kind not in common:
            who = "this side" if kind not in kinds_a else "the peer"
            raise ConfigError(f"transport {kind!r} was asked for but {who} cannot use it (available: {common})")
        return [kind]
    pref = auto_preference()
    prefer_ucx = "ucx" in common and pref != "tcp" and (
        needs_cuda or pref == "ucx" or ucx_has_rdma() or same_host(mine, theirs)
    )
    order = ["ucx", "tcp"] if prefer_ucx else ["tcp"]
    return [k for k in order if k in common]


def torch_uint8() -> "torch.dtype":
    import torch

    return torch.uint8


class SendHandle:
    """Completion handle of :meth:`Link.isend`."""

    __slots__ = ("_future", "_name", "_op", "_t")

    def __init__(self, future: "concurrent.futures.Future[None] | None", name: str, *, op: Any = None,
                 transport: Transport | None = None) -> None:
        self._future = future
        self._name = name
        self._op = op  # a transport send op (async_send transports): the message is already posted
        self._t = transport

    def done(self) -> bool:
        if self._op is not None:
            return bool(self._op.done())
        assert self._future is not None
        if not self._future.done():
            return False
        if self._t is not None and self._future.exception() is None:
            return bool(self._future.result().done())  # posted by the link's thread: is it out?
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the bytes are out of the tensor given to ``isend``.

        Raises:
            TransferTimeout: not done within ``timeout`` (the send goes on).
            the send's own error (PeerLostError, ...).
        """
        if self._op is not None:
            assert self._t is not None
            self._t.wait_send(self._op, timeout=timeout)  # type: ignore[attr-defined]
            return
        assert self._future is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            op = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():
                raise  # the send's own error (TransferTimeout is a TimeoutError too), not this wait's timeout
            raise TransferTimeout(f"isend of {self._name!r} not complete within {timeout}s") from None
        if self._t is not None:  # the link's thread posted it (CUDA isend): now wait for the bytes to leave
            self._op = op
            self._t.wait_send(op, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))  # type: ignore[attr-defined]


_FREE = object()  # a held slot nobody reads any more (see _RecvState.held)


class _RecvState:
    __slots__ = ("spec", "tag", "slots", "next", "held", "events", "device_slot", "staged", "stager")

    def __init__(self, spec: TensorSpec, tag: int, slots: list[Slot], device_slot: Slot | None,
                 stager: Any = None) -> None:
        self.spec = spec
        self.tag = tag
        self.slots = slots
        self.next = 0
        # Slots handed out and not re-posted yet, oldest first: (index, what to wait for before re-posting).
        # None: the work the caller queued on the current stream (the slot was returned to the caller);
        # an event: recv(out=)'s own copy out of a CUDA slot (recorded after it on the caller's stream);
        # _FREE: nothing (a host copy already done) -- it waits only for its turn (slots are re-posted in
        # the order they were received in: the next message lands in the oldest posted slot).
        self.held: collections.deque[tuple[int, Any]] = collections.deque()
        self.events: list[Any] = [None] * len(slots)  # one reusable CUDA event per slot (recv(out=))
        self.device_slot = device_slot  # CUDA slot the staged host bytes are copied into
        self.staged = device_slot is not None
        # tensorwire.gpu.StagedReceiver for a static CUDA spec over a host-only transport (chunked, overlapped);
        # None: whole-message path (CPU specs, dynamic specs, transports that reach CUDA memory)
        self.stager = stager


class _SendState:
    __slots__ = ("spec", "tag", "slot", "step", "lock", "tdtype", "cdtype", "shape", "nbytes", "stager")

    def __init__(self, spec: TensorSpec, tag: int, slot: Slot, stager: Any = None) -> None:
        self.spec = spec
        self.tag = tag
        self.slot = slot  # staging for non-contiguous input or CUDA data over a host-only transport
        self.step = 0
        self.lock = threading.Lock()
        # for the fast check of a static spec (anything else takes spec.check_tensor)
        self.tdtype = spec.torch_dtype if spec.device == "cpu" and not spec.is_dynamic else None
        self.cdtype = spec.torch_dtype if spec.device == "cuda" and not spec.is_dynamic else None
        self.shape = spec.shape
        self.nbytes = spec.nbytes
        # tensorwire.gpu.StagedSender over ``slot`` for a static CUDA spec over a host-only transport
        self.stager = stager


MAX_DEPTH = 64


def _depths(depth: "int | Mapping[str, int] | None", names: Sequence[str]) -> dict[str, int]:
    """``Node.link``'s ``depth`` argument as ``{recv name: slots}`` (validated)."""
    if depth is None:
        return {}
    if isinstance(depth, Mapping):
        unknown = sorted(set(depth) - set(names))
        if unknown:
            raise ConfigError(f"depth names {unknown} are not received on this link (recv: {sorted(names)})")
        items = dict(depth)
    else:
        items = {n: depth for n in names}
    for n, d in items.items():
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= MAX_DEPTH:
            raise ConfigError(f"depth for {n!r} must be an int in [2, {MAX_DEPTH}], got {d!r}")
    return items


class Link:
    """A negotiated channel to one peer. Create with :meth:`Node.link`.

    Attributes:
        peer: the peer's rank.
        transport: the chosen transport's kind ("ucx" or "tcp").
        send_specs / recv_specs: the negotiated specs by name.

    **CUDA specs over a host-only transport** (TCP: ``transport.reaches_cuda``
    is False) travel through pinned host slots. For static specs the bytes are
    cut into chunks by :func:`tensorwire.gpu.chunk_plan` (2 MiB, or the whole
    tensor when small; ``TENSORWIRE_STAGING_CHUNK`` changes it and must be the
    same on both sides), each chunk an ordinary message on the spec's tag, and
    the device<->host copies run on per-link copy streams overlapped with the
    socket (:class:`tensorwire.gpu.StagedSender` / ``StagedReceiver``):

    - ``send``: the copy stream waits for the caller's current stream, all
      device->host copies are queued with one event per chunk, and chunk *i*
      goes to the socket as soon as its event completes, while chunk *i+1* is
      being copied. ``isend`` orders after the stream that was current in the
      thread calling ``isend``.
    - ``recv``: every chunk of both host slots is posted as its own receive; each
      chunk's host->device copy is queued as soon as it lands; the copy stream
      first waits for the current stream (work still reading the previous
      message), and the current stream then waits for the copies' event — no
      device or stream synchronize on the receive path. A host slot is posted
      again (at the next ``recv``) only once the copies out of it completed.

    Dynamic CUDA specs over TCP keep the whole-message path (copy, synchronize
    the current stream, one message with the shape in its header).
    """

    def __init__(self, *, node_rank: int, peer: int, name: str, transport: Transport,
                 send: Sequence[TensorSpec], recv: Sequence[TensorSpec], timeout: float,
                 device: "torch.device | None", depth: Mapping[str, int] | None = None) -> None:
        self.peer = peer
        self.name = name
        self.rank = node_rank
        self._t = transport
        self._any_dtype = transport.any_dtype  # sends may pass the tensor itself (no flat uint8 view)
        self._async = transport.async_send and transport.any_dtype  # isend posts in the caller's thread
        self._queued = 0  # isends on the executor not finished yet
        self.transport = transport.kind
        self._timeout = timeout
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        host_only = not transport.reaches_cuda
        self.send_specs = {s.name: s for s in send}
        self.recv_specs = {s.name: s for s in recv}
        # chunked staging (static CUDA specs over a host-only transport): CUDA calls and per-device copy streams
        self._ops: Any = None
        self._copy_streams: dict[tuple[str, int | None], Any] = {}
        chunk: int | None = None
        if host_only and any(s.device == "cuda" and not s.is_dynamic for s in (*send, *recv)):
            from .gpu import CudaOps, staging_chunk

            self._ops = CudaOps()
            chunk = staging_chunk()
        self._send: dict[str, _SendState] = {}
        for tag, spec in enumerate(sorted(self.send_specs)):
            s = self.send_specs[spec]
            staging_on_host = host_only and s.device == "cuda"
            slot = Slot(s, device=device, host=staging_on_host)
            stager = None
            if staging_on_host and not s.is_dynamic:
                from .gpu import StagedSender, chunk_plan

                assert chunk is not None
                stager = StagedSender(slot.raw, chunk_plan(s.nbytes, chunk), ops=self._ops)
            self._send[spec] = _SendState(s, tag, slot, stager)
        self._recv: dict[str, _RecvState] = {}
        for tag, spec in enumerate(sorted(self.recv_specs)):
            s = self.recv_specs[spec]
            staged = host_only and s.device == "cuda"
            # depth > 2 only where the slot itself is what recv returns (not through a staging slot)
            n_slots = 2 if staged else (depth or {}).get(spec, 2)
            slots = [Slot(s, device=device, host=staged) for _ in range(n_slots)]
            device_slot = Slot(s, device=device) if staged else None
            rx = None
            if staged and not s.is_dynamic:
                from .gpu import StagedReceiver, chunk_plan

                assert chunk is not None and device_slot is not None
                rx = StagedReceiver([sl.raw for sl in slots], device_slot.raw, chunk_plan(s.nbytes, chunk),
                                    ops=self._ops)
            st = _RecvState(s, tag, slots, device_slot, rx)
            self._recv[spec] = st
            if rx is not None:
                rx.post_all(transport, tag)  # both host slots, chunk by chunk
            else:
                for slot in slots:
                    transport.post_recv(tag, slot.raw, header=s.is_dynamic)
        self.bytes_sent = 0
        self.bytes_received = 0

    # -- info -------------------------------------------------------------------
    def __repr__(self) -> str:
        return (f"Link(rank {self.rank} <-> {self.peer}, {self.transport}, send={sorted(self.send_specs)}, "
                f"recv={sorted(self.recv_specs)})")

    def depth(self, name: str) -> int:
        """How many ``recv`` calls of ``name`` a returned slot outlives, plus one (2 unless ``depth`` raised it).

        A CUDA spec staged through host memory (TCP) keeps 2: what ``recv`` returns there is its one
        device slot, valid until the next ``recv``.
        """
        st = self._recv.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} is not received on this link (declared: {sorted(self._recv)})")
        return 2 if st.staged else len(st.slots)

    @property
    def connection(self) -> Transport:
        """The link's data connection. Tags no spec of this link uses are free for a layer that frames its
        own messages on it (``tensorwire.distributed`` makes spec-less links and uses every tag)."""
        return self._t

    def slots(self) -> list[Slot]:
        """Every preallocated slot of this link (for inspection and tests)."""
        out = [st.slot for st in self._send.values()]
        for st in self._recv.values():
            out.extend(st.slots)
            if st.device_slot is not None:
                out.append(st.device_slot)
        return out

    def staging_plan(self, name: str) -> tuple[tuple[int, int], ...] | None:
        """The ``((offset, length), ...)`` chunks ``name`` travels in, or None when it is not chunk-staged."""
        st: _SendState | _RecvState | None = self._send.get(name) or self._recv.get(name)
        if st is None:
            raise KeyError(name)
        return st.stager.plan if st.stager is not None else None

    def _copy_stream(self, device: "torch.device", kind: str) -> Any:
        """This link's copy stream of ``kind`` ("d2h" for sends, "h2d" for receives) on ``device``, made once."""
        key = (kind, device.index)
        stream = self._copy_streams.get(key)
        if stream is None:
            with self._lock:
                stream = self._copy_streams.get(key)
                if stream is None:
                    stream = self._copy_streams[key] = self._ops.new_stream(device)
        return stream

    # -- send -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"link to rank {self.peer} is closed")

    def send(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> None:
        """Send ``tensor`` as ``name`` into the peer's preallocated slot.

        Blocks until the bytes are out of ``tensor`` (it may be modified after).
        CUDA tensors: ordered after the work already queued on the current stream.

        Raises:
            ShapeMismatchError: ``tensor`` differs from the negotiated spec (nothing sent).
            TransferTimeout, PeerLostError, ClosedError.
        """
        if self._queued:
            # isends still queued on the link's thread: this message goes out after them (order per name).
            self.isend(name, tensor, timeout=timeout).wait()
            return
        self._send_impl(name, tensor, timeout, None)

    def _send_impl(self, name: str, tensor: "torch.Tensor", timeout: float | None, stream: Any) -> None:
        """:meth:`send`; ``stream``: the stream a CUDA send orders after (None: the current one)."""
        self._check_open()
        st = self._send.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} was not declared as sent on this link (declared: {sorted(self._send)})")
        if st.tdtype is not None and tensor.dtype is st.tdtype and tensor.shape == st.shape and not tensor.is_cuda:
            # Fast path: static CPU spec, checked without building descriptions.
            if tensor.requires_grad:
                tensor = tensor.detach()
            if tensor.is_contiguous() and tensor.dim():
                with st.lock:  # the step counts only messages that went out (a credit timeout sends nothing)
                    if not st.nbytes:
                        data = st.slot.raw
                    else:
                        data = tensor if self._any_dtype else tensor.view(torch_uint8()).reshape(-1)
                    self._t.send(st.tag, data, step=st.step + 1, timeout=self._timeout if timeout is None else timeout)
                    st.step += 1
                self.bytes_sent += st.nbytes
                return
        elif (st.cdtype is not None and tensor.dtype is st.cdtype and tensor.shape == st.shape and tensor.is_cuda
              and st.slot.is_cuda and st.nbytes and tensor.is_contiguous()):
            # Fast path: static CUDA spec, contiguous, sent straight from device memory. The
            # caller's stream (isend passes the one current in the calling thread) is synchronized
            # first: UCX reads the bytes only after the work queued there is done.
            if tensor.requires_grad:
                tensor = tensor.detach()
            if stream is not None:
                stream.synchronize()
            else:
                sync_current_stream(tensor.device)
            with st.lock:
                self._t.send(st.tag, tensor if self._any_dtype else as_bytes(tensor), step=st.step + 1,
                             timeout=self._timeout if timeout is None else timeout)
                st.step += 1
            self.bytes_sent += st.nbytes
            return
        else:
            st.spec.check_tensor(tensor)
        tensor = tensor.detach()
        shape = tuple(tensor.shape)
        nbytes = tensor.numel() * st.spec.itemsize
        with st.lock:
            if tensor.is_cuda:
                import torch

                if st.stager is not None:
                    self._send_staged(st, tensor, self._timeout if timeout is None else timeout, stream)
                    self.bytes_sent += nbytes
                    return
                # The caller's stream (isend passes the one current in the calling thread): the bytes
                # are read by UCX (device memory) or the socket (pinned staging) only after the work
                # queued there -- and the staging copy, queued on it too -- is done.
                cur = stream if stream is not None else torch.cuda.current_stream(tensor.device)
                if st.slot.is_cuda and tensor.is_contiguous():
                    data = as_bytes(tensor)
                else:
                    with torch.cuda.stream(cur):
                        data = self._stage(st, tensor, shape)
                cur.synchronize()
            elif tensor.is_contiguous():
                data = as_bytes(tensor)
            else:
                data = self._stage(st, tensor, shape)
            self._t.send(st.tag, data[:nbytes] if data.numel() != nbytes else data, step=st.step + 1,
                         shape=shape if st.spec.is_dynamic else None,
                         timeout=self._timeout if timeout is None else timeout)
            st.step += 1
        self.bytes_sent += nbytes

    def _send_staged(self, st: _SendState, tensor: "torch.Tensor", timeout: float, stream: Any) -> None:
        """Chunked, overlapped device->host->socket send of a static CUDA spec (caller holds ``st.lock``)."""
        device = tensor.device
        current = stream if stream is not None else self._ops.current_stream(device)
        if tensor.is_contiguous():
            src = as_bytes(tensor)
        else:
            import torch

            with torch.cuda.stream(current):  # ordered after the writes to ``tensor``; freed after all reads
                src = as_bytes(tensor.contiguous())
        st.step = st.stager.send(self._t, st.tag, src, step=st.step, timeout=timeout, current=current,
                                 side=self._copy_stream(device, "d2h"))

    @staticmethod
    def _stage(st: _SendState, tensor: "torch.Tensor", shape: tuple[int, ...]) -> "torch.Tensor":
        """Copy into the preallocated send slot (no allocation); returns its bytes."""
        view = st.slot.view(shape)
        view.copy_(tensor, non_blocking=view.is_pinned() if not view.is_cuda else True)
        return st.slot.raw

    def isend(self, name: str, tensor: "torch.Tensor", *, timeout: float | None = None) -> SendHandle:
        """Start sending; returns a handle whose ``wait()`` returns once the bytes are out.

        The tensor must not be modified before ``wait()`` returns. Validation
        happens here, before anything is queued.

        Over UCX, a static spec with a contiguous tensor is posted once the
        peer has a slot posted for it, and several isends can be in flight at
        once, one per slot the peer has posted (two per name): message *k+1* is
        posted while *k* is still moving. A host tensor is posted right here,
        in the calling thread -- so this call can wait for a credit, up to
        ``timeout`` (TransferTimeout, nothing sent). A CUDA tensor is not waited
        for here at all: an event recorded on the caller's current stream marks
        when its bytes are final, and the link's thread posts it once that
        event has passed -- the caller keeps queueing GPU work meanwhile (a
        missing credit then surfaces as TransferTimeout from ``wait()``); if
        the stream is already past that point and nothing is queued before
        it, it is posted right here, as a host tensor is.
        Otherwise the send runs, in order, on the link's thread.

        Raises:
            ShapeMismatchError: as :meth:`send`, immediately.
            TransferTimeout: (host tensor posted here) no credit within ``timeout``.
        """
        self._check_open()
        st = self._send.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} was not declared as sent on this link (declared: {sorted(self._send)})")
        st.spec.check_tensor(tensor)
        tmo = self._timeout if timeout is None else timeout
        if (self._async and not st.spec.is_dynamic and st.nbytes and tensor.is_contiguous()
                and (not tensor.is_cuda or (st.slot.is_cuda and st.stager is None))):
            # Posted once the receiver's credit is there and completed by the handle: several
            # messages in flight at once, as many as the peer has slots posted -- the next one is
            # posted while the previous one is moving.
            data = tensor.detach() if tensor.requires_grad else tensor
            if tensor.is_cuda and (self._queued or not current_stream_idle(tensor.device)):
                # CUDA: the caller's thread does not wait for its stream. An event recorded on it
                # marks the point after which the bytes are final; the link's thread waits for that
                # event, then posts (in isend order) -- the caller goes on queueing work meanwhile.
                import torch

                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(tensor.device))
                return SendHandle(self._submit(self._post_after_event, st, data, ev, tmo), name, transport=self._t)
            if not self._queued:
                # Nothing queued before it (and, for CUDA, nothing pending on the stream): post right here.
                return SendHandle(None, name, op=self._post(st, data, tmo), transport=self._t)
        # A chunk-staged send runs on the executor thread, whose current stream is not the caller's:
        # capture the caller's now, so the copies order after the work that writes ``tensor``.
        stream = None
        if tensor.is_cuda:  # the executor thread has its own current stream: order after the caller's
            import torch

            stream = torch.cuda.current_stream(tensor.device)
        return SendHandle(self._submit(self._send_impl, name, tensor, timeout, stream), name)

    def _submit(self, fn: Any, *args: Any) -> "concurrent.futures.Future[Any]":
        """Run ``fn`` on the link's sender thread, after every isend queued before it (order on the tag)."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tw-isend-{self.peer}")
            self._queued += 1  # later isends and sends queue behind this one
            fut = self._executor.submit(fn, *args)
        fut.add_done_callback(self._dequeued)
        return fut

    def _post(self, st: _SendState, data: "torch.Tensor", timeout: float) -> Any:
        """Post ``data`` as the next message of ``st`` (waiting only for a credit); returns the send op."""
        with st.lock:
            op = self._t.start_send(st.tag, data, step=st.step + 1, timeout=timeout)  # type: ignore[attr-defined]
            st.step += 1
        self.bytes_sent += st.nbytes
        return op

    def _post_after_event(self, st: _SendState, data: "torch.Tensor", ev: Any, timeout: float) -> Any:
        """(sender thread) Wait for the caller's work on ``data`` (``ev``), then post it; returns the send op."""
        ev.synchronize()  # releases the GIL
        return self._post(st, data, timeout)

    def _dequeued(self, _: Any) -> None:
        with self._lock:
            self._queued -= 1

    # -- recv -------------------------------------------------------------------
    def recv(self, name: str, *, out: "torch.Tensor | None" = None, timeout: float | None = None) -> "torch.Tensor":
        """Receive the next message of ``name``.

        Returns the preallocated slot tensor (valid until the next ``recv`` of
        ``name``; its shape is the actual shape for dynamic specs), or, with
        ``out``, copies into ``out`` and returns it. A CUDA slot is ready for
        work queued on the current stream (use on another stream needs that
        stream to wait on the current one).

        Raises:
            TransferTimeout: nothing arrived within ``timeout`` (default: the link's).
            ShapeMismatchError: ``out`` does not fit the received tensor.
            PeerLostError, ProtocolError, ClosedError.
        """
        self._check_open()
        st = self._recv.get(name)
        if st is None:
            raise ShapeMismatchError(f"{name!r} is not received on this link (declared: {sorted(self._recv)})")
        if st.stager is not None:
            return self._recv_staged(st, name, out, self._timeout if timeout is None else timeout)
        tmo = self._timeout if timeout is None else timeout
        held = st.held
        # Re-post the oldest held slots: those past their validity (at most depth - 2 stay held once
        # this recv returns one more) and any free one at the head of the line.
        keep = len(st.slots) - 2
        last = None
        synced = False
        while held and (len(held) > keep or held[0][1] is _FREE):
            idx_, wait_for = held.popleft()
            raw = st.slots[idx_].raw
            if wait_for is not None and wait_for is not _FREE:
                wait_for.synchronize()  # recv(out=)'s copy out of it, nothing else
            elif wait_for is None and raw.is_cuda and not synced:
                # UCX may write the next message into this slot as soon as it is posted: work the
                # caller queued on the slot (on the current stream) must be finished first.
                sync_current_stream(raw.device)
                synced = True
            if last is not None:
                self._t.post_recv(st.tag, last, header=st.spec.is_dynamic)
            last = raw
        if last is not None:
            # The last slot goes back and the next message is awaited in one call: UCX does the
            # post once the wait has picked up the message already on its way (transport docs).
            got = self._t.repost_and_wait(st.tag, last, header=st.spec.is_dynamic, timeout=tmo)
        else:
            got = self._t.wait_recv(st.tag, timeout=tmo)
        idx = st.next
        st.next = idx + 1 if idx + 1 < len(st.slots) else 0
        slot = st.slots[idx]
        if got.shape is None and not st.spec.is_dynamic:
            # Static spec (the common case): the slot's full typed view, no shape work per message.
            shape = st.spec.shape
            if got.nbytes != slot.nbytes:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {got.nbytes} bytes for {name!r} {shape}, expected {slot.nbytes}")
            view = slot.tensor
        else:
            shape = got.shape if got.shape is not None else st.spec.shape
            try:
                st.spec.check_shape(shape)
            except ShapeMismatchError as exc:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {name!r} with shape {shape}: {exc}") from exc
            view = slot.view(shape)
            expected = view.numel() * st.spec.itemsize
            if got.nbytes != expected:
                self._release(st, idx)
                raise ProtocolError(f"peer sent {got.nbytes} bytes for {name!r} {shape}, expected {expected}")
        self.bytes_received += got.nbytes
        if st.staged:
            assert st.device_slot is not None
            dev_view = st.device_slot.view(shape)
            dev_view.copy_(view, non_blocking=True)
            import torch

            torch.cuda.current_stream(dev_view.device).synchronize()  # host slot is re-posted right away
            self._t.post_recv(st.tag, slot.raw, header=st.spec.is_dynamic)
            view = dev_view
            if out is None:
                return view
        if out is not None:
            if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
                if not st.staged:
                    held.append((idx, None))
                raise ShapeMismatchError(f"out= for {name!r} is {out.dtype}{list(out.shape)}, received "
                                         f"{view.dtype}{list(view.shape)}")
            out.copy_(view)
            if not st.staged:
                if view.is_cuda:
                    # The copy is queued on the current stream behind whatever the caller queued before:
                    # the slot is held (not re-posted, so UCX cannot write into it) until the copy has
                    # run; the next recv of this name waits for this event, then re-posts it.
                    import torch

                    ev = st.events[idx]
                    if ev is None:
                        ev = st.events[idx] = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(view.device))
                    held.append((idx, ev))
                    return out
                self._release(st, idx)
            return out
        held.append((idx, None))
        return view

    def _release(self, st: _RecvState, idx: int) -> None:
        """Give slot ``idx`` back now if no older slot is still held, else as soon as its turn comes."""
        if st.held:
            st.held.append((idx, _FREE))
        else:
            self._t.post_recv(st.tag, st.slots[idx].raw, header=st.spec.is_dynamic)

    def _recv_staged(self, st: _RecvState, name: str, out: "torch.Tensor | None", timeout: float) -> "torch.Tensor":
        """Chunked, overlapped socket->host->device receive of a static CUDA spec into its device slot."""
        dslot = st.device_slot
        assert dslot is not None
        device = dslot.raw.device
        self.bytes_received += st.stager.recv(self._t, st.tag, timeout=timeout,
                                              current=self._ops.current_stream(device),
                                              side=self._copy_stream(device, "h2d"))
        view = dslot.tensor
        if out is None:
            return view
        if tuple(out.shape) != tuple(view.shape) or out.dtype != view.dtype:
            raise ShapeMismatchError(f"out= for {name!r} is {out.dtype}{list(out.shape)}, received "
                                     f"{view.dtype}{list(view.shape)}")
        out.copy_(view)  # on the current stream, which already waits for the slot's copies
        return out

    # -- lifecycle --------------------------------------------------------------
    def close(self) -> None:
        """Close the data connection and release the slots. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for st in self._recv.values():
            if st.stager is not None and st.stager.pending is not None:
                try:  # host->device copies still reading a host slot: let them finish before the slots can go
                    st.stager.copied[st.stager.pending].synchronize()
                except Exception:  # noqa: BLE001 - closing must not fail on a broken device
                    pass
        self._t.close()

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Node:
    """One per process: control server, data listeners, bootstrap store.

    Args:
        rank, world_size: this process's rank and the number of ranks.
        store: a ``torch.distributed.Store`` (e.g. ``TCPStore``) shared by all
            ranks, used to publish and look up control addresses. ``None``:
            built from MASTER_ADDR/MASTER_PORT: a client of torchrun's agent store
            when TORCHELASTIC_USE_AGENT_STORE=True, else hosted by rank 0 on
            MASTER_PORT (multi-tenant, shared with torch.distributed).
        host: address to bind listeners to and to advertise to peers.
        transport: ``"auto"`` (default; env ``TENSORWIRE_TRANSPORT``), ``"ucx"`` or ``"tcp"``.
        timeout: default timeout (s) for negotiation and transfers (env ``TENSORWIRE_TIMEOUT``).
        peer_timeout: how long an unresponsive peer may stay silent before it
            is declared lost (env ``TENSORWIRE_PEER_TIMEOUT``).
        prefix: store key prefix (``tw.init`` keys it by run id and restart count).
        device: CUDA device for CUDA slots (default: the current device).

    Raises:
        ConfigError: bad arguments or environment.
        TransportError: a listener or the control server could not bind.
    """

    def __init__(self, *, rank: int, world_size: int, store: Any = None, host: str = "127.0.0.1",
                 transport: TransportChoice | None = None, timeout: float | None = None,
                 peer_timeout: float | None = None, prefix: str = "tensorwire/default/0/",
                 device: "torch.device | str | None" = None) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
        env_t = os.environ.get("TENSORWIRE_TRANSPORT")
        if transport is None:
            transport = _check_choice(env_t or "auto", source="TENSORWIRE_TRANSPORT")
        self.transport = _check_choice(transport, source="Node(transport=...)")
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.timeout = float(timeout) if timeout is not None else _env_float("TENSORWIRE_TIMEOUT", DEFAULT_TIMEOUT)
        self.peer_timeout = (float(peer_timeout) if peer_timeout is not None
                             else _env_float("TENSORWIRE_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT))
        self.prefix = prefix
        self.device = device
        self._closed = False
        self._links: list[Link] = []
        self._owns_store = False
        if store is None:
            store = self._store_from_env()
        self.store = store
        from .control import ControlServer

        self._control = ControlServer(host)
        self._listeners: dict[str, Listener] = {}
        try:
            self._open_listeners()
            self.store.set(self._key(f"ctrl/{rank}"), self._control.address)
        except BaseException:
            self.close()
            raise
        log.info("tensorwire node rank %d/%d: control %s, data %s", rank, world_size, self._control.address,
                 ", ".join(f"{k}://{h}:{p}" for k, (h, p) in ((k, v.address) for k, v in self._listeners.items())))

    def _key(self, suffix: str) -> str:
        return self.prefix + suffix

    def _store_from_env(self) -> Any:
        from .torchrun import bootstrap_store

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ConfigError("Node(store=None) needs MASTER_ADDR and MASTER_PORT in the environment, or pass store=")
        try:
            port_n = int(port)
        except ValueError:
            raise ConfigError(f"MASTER_PORT={port!r} is not a port number") from None
        self._owns_store = True
        return bootstrap_store(master_addr=addr, master_port=port_n, rank=self.rank, world_size=self.world_size,
                               use_agent_store=None, timeout=self.timeout)

    def _open_listeners(self) -> None:
        kinds = ["tcp"] if self.transport == "tcp" else (["ucx"] if self.transport == "ucx" else ["ucx", "tcp"])
        for kind in kinds:
            try:
                factory = get_factory(kind)
                self._listeners[kind] = factory(self.host, port=0, peer_timeout=self.peer_timeout)
            except ImportError as exc:
                if self.transport == kind:
                    raise ConfigError(f"transport {kind!r} requested but unavailable: {exc}") from exc
                log.warning("tensorwire: %s transport unavailable (%s); links from rank %d will use TCP",
                            kind, exc, self.rank)
            except TensorWireError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dependency failing to start
                if self.transport == kind:
                    raise TransportError(f"cannot start the {kind} listener: {exc}") from exc
                log.warning("tensorwire: %s listener failed to start (%s); falling back to TCP", kind, exc)

    @property
    def control_address(self) -> str:
        return self._control.address

    def link(self, peer: int, *, send: Iterable[TensorSpec] = (), recv: Iterable[TensorSpec] = (),
             timeout: float | None = None, name: str = "default",
             depth: "int | Mapping[str, int] | None" = None) -> Link:
        """Negotiate a link with ``peer``; both ranks must call this with mirrored specs.

        Args:
            peer: the other rank.
            send: specs this side will send (the peer must list them in its ``recv``).
            recv: specs this side expects (the peer must list them in its ``send``).
            timeout: for negotiation and connection (default: the node's).
            name: distinguishes several links between the same two ranks.
            depth: receive slots per received name (an int for all, or ``{name: n}``; default 2,
                at least 2, at most 64): a slot returned by ``recv`` stays valid until ``depth - 1``
                more ``recv`` calls of its name. Local to this side (the peer's credits follow the
                slots posted); costs ``depth`` x the tensor's bytes. See :meth:`Link.depth`.

        Raises:
            ShapeMismatchError: the declarations differ (raised on both sides;
                names the tensor and both specs).
            ConnectTimeout: the peer did not show up in time.
            ConfigError: bad arguments or incompatible transport requests.
        """
        if self._closed:
            raise ClosedError("node is closed")
        if not isinstance(peer, int) or not 0 <= peer < self.world_size or peer == self.rank:
            raise ConfigError(f"peer must be another rank in [0, {self.world_size}), got {peer!r}")
        send_l, recv_l = list(send), list(recv)
        for s in send_l + recv_l:
            if not isinstance(s, TensorSpec):
                raise ConfigError(f"send/recv take TensorSpec objects, got {type(s).__name__}")
        for label, specs in (("send", send_l), ("recv", recv_l)):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ConfigError(f"duplicate names in {label}: {sorted(n for n in names if names.count(n) > 1)}")
        depths = _depths(depth, [s.name for s in recv_l])
        if any(s.device == "cuda" for s in send_l + recv_l) and not cuda_available():
            raise ConfigError("CUDA specs given but CUDA is not available in this process")
        timeout = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + timeout
        from . import control
        from .v1 import control_pb2, types_pb2

        nonce = new_nonce()
        mine = control_pb2.LinkOffer(
            protocol_version=control.PROTOCOL_VERSION, run_id=self.prefix, from_rank=self.rank, to_rank=peer,
            link_name=name, send=[s.to_proto() for s in send_l], recv=[s.to_proto() for s in recv_l],
            data=[types_pb2.TransportAddress(kind=k, host=lst.address[0], port=lst.address[1])
                  for k, lst in self._listeners.items()],
            transport=self.transport, nonce=nonce, has_cuda=cuda_available(), host_id=host_id(),
        )
        for lst in self._listeners.values():
            lst.expect(nonce)
        self._control.declare(mine)
        try:
            peer_addr = self._lookup(peer, deadline)
            theirs = control.negotiate(peer_addr, mine, timeout=max(0.1, deadline - time.monotonic()))
            if theirs.run_id != mine.run_id:
                raise ProtocolError(f"rank {peer} belongs to run {theirs.run_id!r}, this rank to {mine.run_id!r}")
            peer_send = [TensorSpec.from_proto(m) for m in theirs.send]
            peer_recv = [TensorSpec.from_proto(m) for m in theirs.recv]
            errors = []
            for a, b, what in ((send_l, peer_recv, f"rank {self.rank} sends -> rank {peer} receives"),
                               (peer_send, recv_l, f"rank {peer} sends -> rank {self.rank} receives")):
                try:
                    check_same_specs(a, b, what=what)
                except ShapeMismatchError as exc:
                    errors.append(str(exc))
            if errors:
                # The peer must see the same mismatch: let it fetch our declaration before we go.
                self._control.wait_served(peer, name, max(0.0, min(10.0, deadline - time.monotonic())))
                raise ShapeMismatchError("; ".join(errors))
            needs_cuda = any(s.device == "cuda" for s in send_l + recv_l)
            order = choose_transport(mine, theirs, needs_cuda=needs_cuda)
            if not order:
                raise ConfigError(f"no transport in common with rank {peer}")
            transport = self._connect(order, mine, theirs, deadline)
        finally:
            for lst in self._listeners.values():
                lst.forget(nonce)
        try:
            link = Link(node_rank=self.rank, peer=peer, name=name, transport=transport, send=send_l, recv=recv_l,
                        timeout=self.timeout, device=self.device, depth=depths)
        except BaseException:
            transport.abort()
            raise
        self._links.append(link)
        log.info("tensorwire: link rank %d <-> %d (%s) over %s: %d send, %d recv slots", self.rank, peer, name,
                 transport.describe(), len(send_l), len(recv_l))
        return link

    def _lookup(self, peer: int, deadline: float) -> str:
        from datetime import timedelta

        key = self._key(f"ctrl/{peer}")
        try:
            self.store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            return self.store.get(key).decode()
        except (RuntimeError, TimeoutError) as exc:  # torch raises DistStoreError (a RuntimeError)
            raise ConnectTimeout(f"rank {peer} did not publish its control address in time: {exc}") from exc

    def _connect(self, order: list[str], mine: "control_pb2.LinkOffer", theirs: "control_pb2.LinkOffer",
                 deadline: float) -> Transport:
        """Lower rank dials, higher rank accepts; under auto, UCX failure falls back to TCP loudly."""
        dial = self.rank < theirs.from_rank
        last: BaseException | None = None
        if not dial:
            # Accept whichever transport the dialer manages to connect on.
            kinds = [k for k in order if k in self._listeners]
            while time.monotonic() < deadline:
                for kind in kinds:
                    try:
                        t = self._listeners[kind].accept(mine.nonce, timeout=0.05)
                    except ConnectTimeout:
                        continue
                    if kind != order[0]:
                        log.warning("tensorwire: link with rank %d fell back to %s (peer could not connect over %s)",
                                    theirs.from_rank, kind, order[0])
                    return t
            raise ConnectTimeout(f"rank {theirs.from_rank} did not connect a data channel in time")
        addrs = {d.kind: d for d in theirs.data}
        for i, kind in enumerate(order):
            addr = addrs[kind]
            try:
                factory = get_factory(kind)
                per_try = max(0.1, deadline - time.monotonic()) if i == len(order) - 1 else min(
                    10.0, max(0.1, deadline - time.monotonic()))
                return factory.connect(addr.host, addr.port, theirs.nonce, timeout=per_try,
                                       peer_timeout=self.peer_timeout)
            except (TensorWireError, ImportError, OSError) as exc:
                last = exc
                if i + 1 < len(order):
                    log.warning("tensorwire: %s connection to rank %d at %s:%d failed (%s); falling back to %s",
                                kind, theirs.from_rank, addr.host, addr.port, exc, order[i + 1])
        assert last is not None
        if isinstance(last, TensorWireError):
            raise last
        raise PeerLostError(f"cannot connect to rank {theirs.from_rank}: {last}") from last

    def close(self) -> None:
        """Close every link, the listeners and the control server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in self._links:
            link.close()
        for lst in self._listeners.values():
            lst.close()
        if hasattr(self, "_control"):
            self._control.close()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Node(rank={self.rank}, world_size={self.world_size}, transport={self.transport!r})"
