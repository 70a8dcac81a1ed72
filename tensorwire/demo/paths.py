"""The three paths of ``tensorwire demo``, one class per side: tensorwire, a raw socket, gRPC.

A sender's ``exchange(row, srcs, first)`` sends one exchange's messages and waits
for the acknowledgement; a receiver's ``exchange(row, first, n)`` returns the
``n`` buffers the messages landed in: the receiver has as many buffers per row
as ``tensorwire bench``'s (:func:`~tensorwire.benchmark.worker.recv_slots`) and
reuses them in turn, so after a round each holds the last message into it. What each path does is described in
:mod:`tensorwire.demo`. grpc and numpy are imported on first use.
"""

from __future__ import annotations

import os
import queue
import socket
from typing import Any, Sequence

from tensorwire.benchmark.backends.rawtcp import recv_exact, tune

__all__ = [
    "TwSender",
    "TwReceiver",
    "SocketSender",
    "SocketReceiver",
    "GrpcSender",
    "GrpcReceiver",
    "recv_exact",
    "tune",
]

_GRPC_CHUNK = 1024 * 1024  # a gRPC stream moves a round in chunks of 1 MiB
_GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_GRPC_SERVICE = "twdemo.Exchange"
_ACK = b"k"


class TwSender:
    def __init__(self, link: Any) -> None:
        self.link = link

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        name = f"row{row}"
        for t in srcs:
            self.link.send(name, t)
        self.link.recv("ack")


class TwReceiver:
    def __init__(self, link: Any, ack: Any) -> None:
        self.link = link
        self.ack = ack

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        name = f"row{row}"
        got = [self.link.recv(name) for _ in range(n)]  # (the last message of each slot stays until the next go)
        self.link.send("ack", self.ack)
        return got


class SocketSender:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ack = memoryview(bytearray(1))

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        for t in srcs:
            self.sock.sendall(memoryview(t.numpy()))
        recv_exact(self.sock, self.ack)


class SocketReceiver:
    def __init__(self, sock: socket.socket, buffers: list[list[Any]]) -> None:
        self.sock = sock
        self.views = [[memoryview(b.numpy()) for b in bufs] for bufs in buffers]
        self.buffers = buffers

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        views, bufs = self.views[row], self.buffers[row]
        k = len(views)
        for msg in range(first, first + n):
            recv_exact(self.sock, views[msg % k])
        self.sock.sendall(_ACK)
        return [bufs[msg % k] for msg in range(first, first + n)]


class GrpcSender:
    def __init__(self, address: str, timeout: float) -> None:
        import grpc

        self.timeout = timeout
        self.channel = grpc.insecure_channel(address, options=_GRPC_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        self.unary = self.channel.unary_unary(f"/{_GRPC_SERVICE}/Put")
        self.stream = self.channel.stream_unary(f"/{_GRPC_SERVICE}/Stream")
        hello = self.channel.unary_unary(f"/{_GRPC_SERVICE}/Hello")
        self.server_pid = int(hello(b"", timeout=timeout))
        self.meta: dict[tuple[int, int], tuple[tuple[str, str], ...]] = {}

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        meta = self.meta.get((row, first))
        if meta is None:  # where the server puts the messages: its first buffer of the round
            meta = self.meta[(row, first)] = (("tw-row", str(row)), ("tw-first", str(first)))
        if len(srcs) == 1:
            reply = self.unary(srcs[0].numpy().tobytes(), timeout=self.timeout, metadata=meta)
        else:

            def chunks() -> Any:
                for t in srcs:
                    a = t.numpy()
                    for off in range(0, len(a), _GRPC_CHUNK):
                        yield a[off : off + _GRPC_CHUNK].tobytes()

            reply = self.stream(chunks(), timeout=self.timeout, metadata=meta)
        if reply != _ACK:
            raise ConnectionError(f"unexpected gRPC reply {reply[:16]!r}")

    def close(self) -> None:
        self.channel.close()


class GrpcReceiver:
    """A gRPC server in this process (rank 1's); its handlers hand each finished round to :meth:`exchange`."""

    def __init__(self, buffers: list[list[Any]], timeout: float) -> None:
        import grpc
        from concurrent import futures

        self.buffers = buffers
        self.arrays = [[b.numpy() for b in bufs] for bufs in buffers]
        self.timeout = timeout
        self.done: queue.Queue[BaseException | None] = queue.Queue()
        handlers = grpc.method_handlers_generic_handler(
            _GRPC_SERVICE,
            {
                "Hello": grpc.unary_unary_rpc_method_handler(lambda req, ctx: str(os.getpid()).encode()),
                "Put": grpc.unary_unary_rpc_method_handler(self._put),
                "Stream": grpc.stream_unary_rpc_method_handler(self._stream),
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_GRPC_OPTIONS)
        self.server.add_generic_rpc_handlers((handlers,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @staticmethod
    def _where(context: Any) -> tuple[int, int]:
        meta = dict(context.invocation_metadata())
        return int(meta["tw-row"]), int(meta["tw-first"])

    def _put(self, request: bytes, context: Any) -> bytes:
        import numpy as np

        try:
            row, first = self._where(context)
            arrays = self.arrays[row]
            dst = arrays[first % len(arrays)]
            dst[:] = np.frombuffer(request, dtype=np.uint8)
            self.done.put(None)
        except BaseException as exc:
            self.done.put(exc)
            raise
        return _ACK

    def _stream(self, chunks: Any, context: Any) -> bytes:
        import numpy as np

        try:
            row, first = self._where(context)
            arrays = self.arrays[row]
            msg, off = first, 0
            for chunk in chunks:
                dst = arrays[msg % len(arrays)]
                dst[off : off + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                off += len(chunk)
                if off == len(dst):
                    msg, off = msg + 1, 0
            if off:
                raise ValueError(f"a gRPC stream ended inside message {msg}")
            self.done.put(None)
        except BaseException as exc:
            self.done.put(exc)
            raise
        return _ACK

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        err = self.done.get(timeout=self.timeout)
        if err is not None:
            raise err
        bufs = self.buffers[row]
        return [bufs[msg % len(bufs)] for msg in range(first, first + n)]

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(3.0)
