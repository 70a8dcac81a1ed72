"""gRPC as a tensor transport, done as well as gRPC allows.

- ``unary``: one unary call per message, the request is the raw bytes (no
  protobuf wrapper, message limits raised); the response is the ack. A stream
  of sends is a series of calls (each waits for its response: that is what a
  unary API gives).
- ``stream``: client-streaming; each message goes as ``grpc_chunk``-sized
  chunks that the server writes into a buffer it allocated once per size. In
  ``uni`` all messages of a batch ride one call (its response is the one ack);
  in ``rtt`` each message is its own call. This is the fairest gRPC.

The server (rank 1) writes every message into its preallocated buffer (the
copy out of gRPC's own bytes is what receiving a tensor over gRPC costs) and
hands it to the sink. The message size travels as call metadata.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from tensorwire.benchmark.backends.base import PairContext, Prepare
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    from tensorwire.config import Steps
    from tensorwire.worker import Sink

_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.so_reuseport", 0),
]
_SERVICE = "twbench.Bench"
_ACK = b"k"


def _import_grpc():
    import grpc

    return grpc


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        grpc = _import_grpc()
        port = int(ctx.lookup("grpc/port"))
        self.channel = grpc.insecure_channel(f"{ctx.cfg.host}:{port}", options=_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=ctx.timeout)
        self.unary = self.channel.unary_unary(f"/{_SERVICE}/Put")
        self.stream = self.channel.stream_unary(f"/{_SERVICE}/Stream")
        self.chunk = ctx.cfg.grpc_chunk
        self.streaming = arg == "stream"
        self.src: "torch.Tensor | None" = None
        self.host: "np.ndarray | None" = None
        self.stage: "torch.Tensor | None" = None
        self.meta: tuple[tuple[str, str], ...] = ()

    def open(self, size: int, src: "torch.Tensor") -> None:
        import torch

        self.src = src
        if src.is_cuda:
            self.stage = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self.host = self.stage.numpy()
        else:
            self.host = src.numpy()
        self.meta = (("tw-size", str(size)),)

    def _host_bytes(self) -> "np.ndarray":
        if self.stage is not None:
            self.stage.copy_(self.src)
        assert self.host is not None
        return self.host

    def _chunks(self) -> Iterator[bytes]:
        host = self._host_bytes()
        n = len(host)
        for off in range(0, n, self.chunk):
            yield host[off : off + self.chunk].tobytes()

    def send(self) -> None:
        if self.streaming:
            self._call(self._chunks())
        else:
            self.unary(self._host_bytes().tobytes(), timeout=self.ctx.timeout, metadata=self.meta)

    def _call(self, it: Iterator[bytes]) -> None:
        if self.stream(it, timeout=self.ctx.timeout, metadata=self.meta) != _ACK:
            raise RuntimeError("unexpected gRPC response")

    def wait_ack(self) -> None:
        """The response of each call is its ack."""

    def run_uni(self, n: int, prepare: Prepare) -> None:
        if not self.streaming:
            super().run_uni(n, prepare)
            return

        def all_messages() -> Iterator[bytes]:
            for _ in range(n):
                prepare()
                yield from self._chunks()

        self._call(all_messages())

    def close_size(self) -> None:
        self.src = self.stage = self.host = None

    def close(self) -> None:
        self.ctx.publish("grpc/done", "1")
        self.channel.close()


class Receiver(_Receiver):
    """A gRPC server; :meth:`serve` runs it until every planned message arrived."""

    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.buffers: dict[int, tuple[Any, "np.ndarray"]] = {}
        self.sink: "Sink | None" = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    # The primitive methods are unused: gRPC's server drives the receiving.
    def open(self, size: int) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    def recv(self):  # pragma: no cover - not used
        raise NotImplementedError

    def ack(self) -> None:  # pragma: no cover - not used
        raise NotImplementedError

    def _buffer(self, size: int) -> tuple[Any, "np.ndarray"]:
        """(tensor handed to the sink, host array written by the handler): allocated once per size."""
        got = self.buffers.get(size)
        if got is None:
            import torch

            for old in list(self.buffers):
                del self.buffers[old]  # one size at a time, like the other backends
            if self.ctx.device.type == "cuda":
                host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                dev = torch.empty(size, dtype=torch.uint8, device=self.ctx.device)
                got = (dev, host)
            else:
                host = torch.empty(size, dtype=torch.uint8)
                got = (host, host)
            self.buffers[size] = got
        return got

    def _deliver(self, size: int, tensor: Any, host: Any) -> None:
        if tensor is not host:
            tensor.copy_(host)
        assert self.sink is not None
        self.sink.got(size, tensor)
        if self.sink.complete():
            self.finished.set()

    @staticmethod
    def _size(context: Any) -> int:
        for k, v in context.invocation_metadata():
            if k == "tw-size":
                return int(v)
        raise ValueError("call without tw-size metadata")

    def _put(self, request: bytes, context: Any) -> bytes:
        try:
            import numpy as np

            size = len(request)
            tensor, host = self._buffer(size)
            host.numpy()[:] = np.frombuffer(request, dtype=np.uint8)
            self._deliver(size, tensor, host)
            return _ACK
        except BaseException as exc:
            self._fail(exc, context)
            raise

    def _stream(self, request_iterator: Iterator[bytes], context: Any) -> bytes:
        try:
            import numpy as np

            size = self._size(context)
            tensor, host = self._buffer(size)
            dst = host.numpy()
            off = 0
            for chunk in request_iterator:
                k = len(chunk)
                dst[off : off + k] = np.frombuffer(chunk, dtype=np.uint8)
                off += k
                if off == size:
                    self._deliver(size, tensor, host)
                    off = 0
                elif off > size:
                    raise ValueError(f"chunks overran the {size}-byte message")
            if off:
                raise ValueError(f"call ended mid-message ({off} of {size} bytes)")
            return _ACK
        except BaseException as exc:
            self._fail(exc, context)
            raise

    def _fail(self, exc: BaseException, context: Any) -> None:
        if self.error is None:
            self.error = exc
        self.finished.set()

    def serve(self, steps: "list[Steps]", patterns: tuple[str, ...], sink: "Sink") -> None:
        grpc = _import_grpc()
        from concurrent import futures

        self.sink = sink
        handlers = grpc.method_handlers_generic_handler(
            _SERVICE,
            {
                "Put": grpc.unary_unary_rpc_method_handler(self._put),
                "Stream": grpc.stream_unary_rpc_method_handler(self._stream),
            },
        )
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_OPTIONS)
        server.add_generic_rpc_handlers((handlers,))
        port = server.add_insecure_port(f"{self.ctx.cfg.host}:0")
        server.start()
        try:
            self.ctx.publish("grpc/port", str(port))
            deadline = time.monotonic() + self.ctx.cfg.backend_timeout()
            while not self.finished.wait(0.5):
                if time.monotonic() > deadline:
                    raise TimeoutError("gRPC server: the planned messages did not all arrive in time")
            if self.error is not None:
                raise self.error
            # Let the last response reach the client before stopping.
            self.ctx.lookup("grpc/done", timeout=self.ctx.timeout)
        finally:
            server.stop(grace=1.0).wait(3.0)
