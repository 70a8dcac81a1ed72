"""``ProcessGroupTensorwire``: a ``torch.distributed.ProcessGroup`` whose point-to-point calls run on tensorwire.

Made by torch through the creator registered as backend ``"tensorwire"``
(:func:`tensorwire.distributed.register`), from the store, rank, size and
timeout torch hands it. At creation the group:

1. starts a :class:`tensorwire.Node` (control server and data listeners) whose
   store keys live under the group's own prefix -- torch's per-group store
   prefix, then ``tensorwire/<run id>/<restart>/<n>/`` where ``n`` counts the
   groups of that name this process made (the same count on every member),
   so elastic restarts, re-initialisation and several groups never read each
   other's addresses;
2. connects to every other rank of the group, one spec-less link per pair, in
   the same global order on every rank (no cycle can wait on itself); the
   transport follows ``TENSORWIRE_TRANSPORT`` and the usual ``auto`` rule.

Point-to-point (``send``/``recv`` and everything built on them: ``isend``,
``irecv``, ``batch_isend_irecv``, ``send_object_list``, pipelining) runs on
those links (:mod:`.channel`), CUDA tensors with NCCL's stream semantics
(:mod:`.streams`). A CUDA operation that fails after its ``wait()`` returned
(a stream waited for it, then went on) makes every later call on the group
raise, as NCCL's asynchronous error handling does. Collectives are delegated to an inner group
built from the same store under a prefix of its own: gloo for CPU tensors,
NCCL for CUDA tensors, each made on the first collective for its device type
(every rank runs collectives in the same order, so every rank makes it then).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import lifecycle
from ..errors import ConfigError
from ..observe import GroupWatch
from ..p2p.bootstrap import reachable_address
from ..p2p.node import Node
from ..p2p.torchrun import TorchrunEnv
from ..settings import setting
from . import copyengine
from .channel import MAX_TAG, Peer, SlotPool, check_tag
from .errors import GroupClosed, translate
from .streams import CudaOps
from .work import Completer, Work

__all__ = ["ProcessGroupTensorwire", "create", "BACKEND_NAME"]

log = logging.getLogger(__name__)

BACKEND_NAME = "tensorwire"
_GENERATIONS: dict[str, itertools.count] = {}
_GENERATIONS_LOCK = threading.Lock()


def _generation(key: str) -> int:
    with _GENERATIONS_LOCK:
        counter = _GENERATIONS.setdefault(key, itertools.count())
        return next(counter)


class ProcessGroupTensorwire(dist.ProcessGroup):
    """Point-to-point over tensorwire links, collectives over an inner gloo/NCCL group.

    Args:
        store: the store torch hands the backend creator (already prefixed per group by torch).
        rank, size: this rank in the group and the group's size.
        timeout: the group's timeout: connection set-up, and every ``Work.wait()`` without its own.
        group_id: torch's name of the group (keys the count of re-made groups of one name).
        transport: ``"auto"``, ``"ucx"`` or ``"tcp"`` (default: ``TENSORWIRE_TRANSPORT``, else auto).
        host: address to listen on and advertise (default: ``TENSORWIRE_HOST``, else ``MASTER_ADDR``
            when it is an address of this machine's interfaces, else 127.0.0.1 -- see :func:`_host`).

    Raises:
        ConnectTimeout: a peer did not come up within ``timeout``.
        ConfigError: bad transport choice or environment.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        *,
        group_id: str = "",
        transport: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # torch prefixes the store by group name already; the count of groups of that name made by this
        # process (the same on every member) keeps a re-made group off the keys of an earlier one
        self._prefix = f"tensorwire/{run}/{restart}/{_generation(f'{run}/{restart}/{group_id}')}/"
        self._closed = False
        self._lock = threading.Lock()
        self._inner: dict[str, Any] = {}
        self._pool = SlotPool()
        self._completer = Completer(str(rank))
        self._ops = CudaOps()
        self._async_error: BaseException | None = None
        self._peers: dict[int, Peer] = {}
        self._watchdog: copyengine.Watchdog | None = None
        self._node = Node(
            rank=rank,
            world_size=size,
            store=store,
            host=host or _host(),
            transport=transport,  # type: ignore[arg-type]  # checked by Node
            timeout=self._timeout,
            prefix=self._prefix,
        )
        try:
            for peer in range(size):
                if peer != rank:
                    link = self._node.link(peer, name="pg", timeout=self._timeout, cuda_hint=True)
                    self._peers[peer] = Peer(
                        link,
                        rank=rank,
                        group=self._prefix,
                        timeout=self._timeout,
                        pool=self._pool,
                        completer=self._completer,
                        ops=self._ops,
                        on_async_error=self._async_failed,
                    )
            for p in self._peers.values():
                p.settle(self._timeout)
            self._watchdog = copyengine.setup(store, self._prefix, rank, self._peers, self._timeout)
        except BaseException:
            for p in self._peers.values():
                if p.ce is not None:
                    p.ce.close(GroupClosed("the group's creation failed"))
            self._node.close()
            raise
        # counts and profiler ranges of send/recv (tensorwire.observe); set_path relabels a peer's CUDA traffic
        self._watch = GroupWatch(
            {r: p.transport for r, p in self._peers.items()},
            do_send=self._send_now,
            do_recv=self._recv_now,
            cuda=torch.cuda.is_available(),
        )
        for r, p in self._peers.items():
            if p.ce is not None:
                self._watch.set_path(r, cuda="ce")
        kinds = sorted({p.transport.kind for p in self._peers.values()} | ({"ce"} if self._watchdog else set()))
        log.info(
            "tensorwire.distributed: rank %d/%d connected to %d peers over %s",
            rank,
            size,
            len(self._peers),
            ",".join(kinds) or "-",
        )
        # never destroyed by the script (no destroy_process_group): aborted at interpreter exit, before the
        # interpreter tears modules down (tensorwire.lifecycle)
        lifecycle.track(self, close="abort")

    # -- identity ----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    # rank() and size() answered in Python: torch's own ones go through pybind11's check for a Python override of
    # the C++ method (~1.3 us a call on the 2-core VM, against 0.05), and ``dist.send`` asks rank() every time
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    #: torch asks a group made for a bound device (``init_process_group(..., device_id=...)``) whether its backend
    #: can split communicators; this one makes its links itself
    supports_splitting = False

    def _get_backend(self, device: Any) -> "ProcessGroupTensorwire":
        """The backend torch looks up per device: this group itself for cpu and cuda.

        torch keeps a Python process group as the group itself and registers no per-device backend for it, so
        its own lookup fails ("No backend type associated with device type cuda") -- which broke
        ``new_group(backend="tensorwire")`` under a default group made with ``device_id=``.
        """
        kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"backend 'tensorwire' serves cpu and cuda tensors, not {device}")
        return self

    @property
    def transports(self) -> dict[int, str]:
        """The transport kind of the connection to each peer (for logs and tests); ``+ce`` where CUDA tensors
        take the copy-engine path."""
        return {p: peer.transport.kind + ("+ce" if peer.ce is not None else "") for p, peer in self._peers.items()}

    @property
    def ce_probes(self) -> dict[int, str]:
        """What the copy-engine path's set-up probe found for each peer on this host (``passed``, ``skipped ...``,
        ``failed: ...``: its CUDA tensors then go over UCX); peers whose pair was never made are absent."""
        return {p: peer.ce_probe for p, peer in self._peers.items() if peer.ce_probe}

    def __repr__(self) -> str:
        return f"ProcessGroupTensorwire(rank={self._rank}, size={self._size})"

    # -- asynchronous errors ---------------------------------------------------------
    def _async_failed(self, exc: BaseException) -> None:
        """A CUDA operation failed after its ``wait()`` had returned (a stream waited for it, then went on)."""
        with self._lock:
            if self._async_error is not None or self._closed:
                return
            self._async_error = exc
        log.error(
            "tensorwire.distributed: rank %d: a CUDA operation failed after its wait() returned; the stream that "
            "waited for it went on with undefined bytes, and every later call on this group raises: %s",
            self._rank,
            exc,
        )

    def _check_async(self, what: str) -> None:
        err = self._async_error
        if err is not None:
            raise type(err)(
                f"{what}: an earlier CUDA operation of this group failed after its wait() had returned (the stream "
                f"that waited for it went on with undefined bytes): {err}. Destroy the group and make a new one"
            ) from err

    # -- point-to-point -----------------------------------------------------------------
    def _peer(self, rank: int, what: str) -> Peer:
        if self._closed:
            raise GroupClosed(f"{what}: the tensorwire process group was shut down")
        self._check_async(what)
        peer = self._peers.get(rank)
        if peer is None:
            raise ConfigError(f"{what}: rank {rank} is not another rank of this group of {self._size}")
        return peer

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        return self._watch.send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        return self._watch.recv(tensors, srcRank, tag)

    def _send_now(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        return self._peer_for(tensors, dstRank, tag, "send").isend(tensors[0], tag)

    def _recv_now(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        return self._peer_for(tensors, srcRank, tag, "recv").irecv(tensors[0], tag)

    def _peer_for(self, tensors: list[torch.Tensor], rank: int, tag: int, what: str) -> Peer:
        """The peer of a point-to-point call: the usual case checked inline, anything else by :meth:`_checked`."""
        peer = self._peers.get(rank)
        if (
            peer is None
            or self._closed
            or self._async_error is not None
            or len(tensors) != 1
            or type(tag) is not int
            or not 0 <= tag <= MAX_TAG
        ):
            peer = self._checked(tensors, rank, tag, what)
        return peer

    def _checked(self, tensors: list[torch.Tensor], rank: int, tag: int, what: str) -> Peer:
        """The peer of a send/recv whose arguments the fast check did not pass: raises what is wrong."""
        if len(tensors) != 1:
            raise ConfigError(f"{what} takes exactly one tensor, got {len(tensors)}")
        check_tag(tag)
        return self._peer(rank, what)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        raise ConfigError(
            "backend 'tensorwire' receives from a given rank only: pass src= to recv/irecv (or use P2POp with a "
            "peer); to take whichever message comes first, post an irecv per possible source and wait on them"
        )

    # -- collectives: the inner gloo / NCCL group ----------------------------------
    def _inner_for(self, device_type: str) -> Any:
        self._check_async("collective")
        inner = self._inner.get(device_type)
        if inner is not None:
            return inner
        with self._lock:
            if self._closed:
                raise GroupClosed("collective on a tensorwire process group that was shut down")
            inner = self._inner.get(device_type)
            if inner is None:
                store = dist.PrefixStore(f"{self._prefix}inner/{device_type}/", self._store)
                if device_type == "cuda":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = timedelta(seconds=self._timeout)
                    inner = dist.ProcessGroupNCCL(store, self._rank, self._size, opts)
                elif device_type == "cpu":
                    inner = dist.ProcessGroupGloo(store, self._rank, self._size, timedelta(seconds=self._timeout))
                else:
                    raise ConfigError(f"backend 'tensorwire' has no collectives for {device_type} tensors")
                self._inner[device_type] = inner
        return inner

    def _inner_of(self, *tensor_lists: Any) -> Any:
        for item in tensor_lists:
            t = _first_tensor(item)
            if t is not None:
                return self._inner_for(t.device.type)
        return self._inner_for("cpu")

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._inner_of(tensors).allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._inner_of(tensors).allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.BroadcastOptions() if opts is None else opts
        return self._inner_of(tensors).broadcast(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.ReduceOptions() if opts is None else opts
        return self._inner_of(tensors).reduce(tensors, opts)

    def barrier(self, opts: Any = None) -> Any:
        opts = dist.BarrierOptions() if opts is None else opts
        inner = self._inner.get("cuda") if "cpu" not in self._inner and "cuda" in self._inner else None
        return (inner or self._inner_for("cpu")).barrier(opts)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = dist.AllgatherOptions() if opts is None else opts
        return self._inner_of(input_tensors).allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.AllgatherOptions() if opts is None else opts
        return self._inner_of(input)._allgather_base(output, input, opts)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = dist.AllgatherOptions() if opts is None else opts
        return self._inner_of(inputs).allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = dist.GatherOptions() if opts is None else opts
        return self._inner_of(input_tensors).gather(output_tensors, input_tensors, opts)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        opts = dist.ScatterOptions() if opts is None else opts
        return self._inner_of(output_tensors).scatter(output_tensors, input_tensors, opts)

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> Any:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._inner_of(output_tensors).reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._inner_of(output)._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._inner_of(outputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = dist.AllToAllOptions() if opts is None else opts
        return self._inner_of(input_tensors).alltoall(output_tensors, input_tensors, opts)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002 - the name torch gives this argument
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Any:
        opts = dist.AllToAllOptions() if opts is None else opts
        return self._inner_of(input).alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    # -- lifecycle ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close every link, thread, listener and inner group. Idempotent; pending works fail with GroupClosed."""
        self._close(abort=False)

    def abort(self) -> None:
        """As :meth:`shutdown`, without waiting for anything in flight."""
        self._close(abort=True)

    def _close(self, *, abort: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inner = list(self._inner.values())
            self._inner.clear()
        reason = GroupClosed(
            f"the tensorwire process group (rank {self._rank}) was {'aborted' if abort else 'shut down'}"
        )
        for peer in self._peers.values():
            try:
                peer.close(reason, abort=abort)
            except Exception as exc:  # noqa: BLE001 - closing goes on
                log.debug("closing the connection to rank %d: %s", peer.peer, exc)
        self._completer.close(fail=lambda w: w._finish(reason))
        if self._watchdog is not None:
            self._watchdog.close()
        self._node.close()
        for backend in inner:
            try:
                backend.abort() if abort else backend.shutdown()
            except Exception as exc:  # noqa: BLE001 - gloo may not implement shutdown; it is freed with us
                log.debug("closing the inner group: %s", exc)
        lifecycle.untrack(self)

    def __del__(self) -> None:  # pragma: no cover - interpreter teardown
        try:
            if not self._closed:
                self._close(abort=True)
        except Exception:  # noqa: BLE001
            pass


def _first_tensor(item: Any) -> torch.Tensor | None:
    if isinstance(item, torch.Tensor):
        return item
    if isinstance(item, (list, tuple)):
        for x in item:
            t = _first_tensor(x)
            if t is not None:
                return t
    return None


def _host() -> str:
    """Address to listen on and advertise, by the rules of ``tw.init``: TENSORWIRE_HOST, else (under torchrun)
    this host's address toward MASTER_ADDR (loopback for a single-node job), else 127.0.0.1."""
    explicit = setting("host") or ""
    if explicit:
        return explicit
    if os.environ.get("MASTER_ADDR") and os.environ.get("RANK") is not None:
        try:
            tr = TorchrunEnv.from_environ()
        except ConfigError:
            return "127.0.0.1"  # not a complete torchrun environment (explicit store, env:// by hand)
        return reachable_address(tr)
    return "127.0.0.1"


def create(store: Any, rank: int, size: int, timeout: timedelta, *, group_id: str = "") -> ProcessGroupTensorwire:
    """The creator torch calls for ``backend="tensorwire"``."""
    try:
        return ProcessGroupTensorwire(store, rank, size, timeout, group_id=group_id)
    except Exception as exc:
        raise translate(exc, f"creating the tensorwire process group (rank {rank} of {size})") from exc
