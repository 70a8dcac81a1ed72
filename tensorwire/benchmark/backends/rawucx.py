"""Raw ucxx (UCX) through its core API: tag send/recv, the calling thread polls ``worker.progress()``.

This is UCX at its best from Python on this kind of host (ANCHORS: the
default progress thread is several times slower). Host buffers go as NumPy
views, CUDA buffers through ``__cuda_array_interface__`` (UCX picks cuda_ipc /
cuda_copy by itself). Tags: 1 = data (0 -> 1), 2 = ack (1 -> 0).

Two ways to connect, two backends:

- ``raw-ucxx``: endpoints from exchanged *worker addresses* (through the store),
  without peer error handling. On one host UCX then uses shared memory (sysv /
  posix) for small messages and cma (single-copy ``process_vm_readv``) for the
  rendezvous of large ones (``UCX_PROTO_INFO=y`` shows it).
- ``raw-ucxx-cm``: a ``UCXListener`` and ``UCXEndpoint.create(host, port)``
  (UCX's sockaddr connection manager, endpoints with peer error handling), as
  ``ucxx.create_listener`` and tensorwire's UCX transport connect. UCX 1.21
  then leaves out every shared-memory transport (they cannot report a failed
  peer) and runs everything over ``tcp/lo``, bounce-buffer "fragmented"
  rendezvous included: several times slower on one host.
- ``raw-ucxx-cmnoerr``: as ``raw-ucxx-cm`` with endpoints *without* error
  handling: shared memory and cma come back (it is the error handling, not the
  connection manager, that leaves them out).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tensorwire.benchmark.backends.base import BackendUnavailable, PairContext, Prepare
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender

if TYPE_CHECKING:  # pragma: no cover
    import torch

DATA_TAG, ACK_TAG = 1, 2


class _Ucx:
    """One UCX context + worker with a bounded polling wait."""

    def __init__(self, timeout: float) -> None:
        import os

        # ucxx sets UCX_MEMTYPE_CACHE at import, which UCX 1.21 no longer knows and warns about on stdout;
        # this is a benchmark process of its own, so silence that warning here.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        try:
            import ucxx._lib.libucxx as u
            from ucxx._lib.arr import Array
        except ImportError as exc:
            raise BackendUnavailable(f"ucxx is not importable: {exc}") from exc
        self.u = u
        self.Array = Array
        self.ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
        self.worker = u.UCXWorker(self.ctx)
        self.timeout = timeout

    def array(self, t: "torch.Tensor") -> Any:
        return self.Array(t if t.is_cuda else t.numpy())

    def wait(self, *reqs: Any) -> None:
        progress = self.worker.progress
        deadline = None
        spins = 0
        for r in reqs:
            while not r.completed:
                progress()
                spins += 1
                if spins & 0x3FF == 0:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.timeout
                    elif now > deadline:
                        raise TimeoutError(f"ucxx request not complete within {self.timeout}s")
            r.check_error()

    def tag(self, n: int) -> Any:
        return self.u.UCXXTag(n)


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        import torch

        self.ucx = _Ucx(ctx.timeout)
        if arg not in ("cm", "cmnoerr"):
            ctx.publish("ucxx/addr0", self.ucx.worker.address.tobytes())
            peer = self.ucx.u.UCXAddress.create_from_buffer(ctx.lookup("ucxx/addr1"))
            self.ep = self.ucx.u.UCXEndpoint.create_from_worker_address(self.ucx.worker, peer, False)
        else:
            port = int(ctx.lookup("ucxx/port"))
            self.ep = self.ucx.u.UCXEndpoint.create(self.ucx.worker, ctx.cfg.host, port, arg == "cm")
        self.ack_arr = self.ucx.array(torch.zeros(1, dtype=torch.uint8))
        self.data_tag, self.ack_tag = self.ucx.tag(DATA_TAG), self.ucx.tag(ACK_TAG)
        self.src_arr: Any = None

    def open(self, size: int, src: "torch.Tensor") -> None:
        self.src_arr = self.ucx.array(src)

    def send(self) -> None:
        self.ucx.wait(self.ep.tag_send(self.src_arr, tag=self.data_tag))

    def wait_ack(self) -> None:
        self.ucx.wait(self.ep.tag_recv(self.ack_arr, tag=self.ack_tag))

    def rtt_once(self, prepare: Prepare) -> None:
        prepare()
        ack = self.ep.tag_recv(self.ack_arr, tag=self.ack_tag)  # posted first: no unexpected-message path
        self.ucx.wait(self.ep.tag_send(self.src_arr, tag=self.data_tag), ack)

    def close_size(self) -> None:
        self.src_arr = None


class Receiver(_Receiver):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        import torch

        self.ucx = _Ucx(ctx.timeout)
        if arg not in ("cm", "cmnoerr"):
            ctx.publish("ucxx/addr1", self.ucx.worker.address.tobytes())
            peer = self.ucx.u.UCXAddress.create_from_buffer(ctx.lookup("ucxx/addr0"))
            self.ep = self.ucx.u.UCXEndpoint.create_from_worker_address(self.ucx.worker, peer, False)
        else:
            eps: list[Any] = []
            self.listener = self.ucx.u.UCXListener.create(
                self.ucx.worker,
                0,
                lambda req: eps.append(self.listener.create_endpoint_from_conn_request(req, arg == "cm")),
            )
            ctx.publish("ucxx/port", str(self.listener.port))
            deadline = time.monotonic() + ctx.timeout
            while not eps:
                self.ucx.worker.progress()
                if time.monotonic() > deadline:
                    raise TimeoutError("no ucxx connection arrived")
                time.sleep(0.0005)
            self.ep = eps[0]
        self.ack_arr = self.ucx.array(torch.ones(1, dtype=torch.uint8))
        self.data_tag, self.ack_tag = self.ucx.tag(DATA_TAG), self.ucx.tag(ACK_TAG)
        self.bufs: list[tuple["torch.Tensor", Any]] = []
        self.turn = 0
        # "2buf": receive into two buffers in turn, as a double-buffered receiver (and a Link's two slots) does
        self.nbufs = 2 if arg == "2buf" else 1

    def open(self, size: int) -> None:
        import torch

        for _ in range(self.nbufs):
            buf = torch.empty(size, dtype=torch.uint8, device=self.ctx.device)
            self.bufs.append((buf, self.ucx.array(buf)))

    def recv(self) -> "torch.Tensor":
        buf, arr = self.bufs[self.turn]
        self.turn = (self.turn + 1) % len(self.bufs)
        self.ucx.wait(self.ep.tag_recv(arr, tag=self.data_tag))
        return buf

    def ack(self) -> None:
        self.ucx.wait(self.ep.tag_send(self.ack_arr, tag=self.ack_tag))

    def close_size(self) -> None:
        self.bufs.clear()
        self.turn = 0
