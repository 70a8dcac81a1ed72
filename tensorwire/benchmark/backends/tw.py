"""tensorwire itself: a real :class:`tensorwire.Node` per process and one :class:`~tensorwire.Link` per size.

Each message size gets its own link (``name="bench-<size>"``): its slots are
allocated when it is negotiated, so the first transfer of a size is the first
transfer of fresh slots. Data goes 0 -> 1 on spec ``data`` (uint8[size] on the
bench device), the ack 1 -> 0 on spec ``ack`` (uint8[1] on the host).
The transport is the backend's argument (``tcp``/``ucx``) or ``auto``; ``tcp-stream`` is TCP with
cross-memory attach off in this worker process (``TENSORWIRE_CMA=off``), so one run compares both; ``ucx-isend`` sends the
stream pattern through ``Link.isend`` with up to two messages in flight, ``ucx-isend4`` with up to four
(the receiver's link made with ``depth=4``).
The sender closes a size's link first (the receiver waits for its word on the
store): a receiver closing right after its last ack can make the sender's
``recv`` of that ack fail (seen with the UCX transport: ``Link.recv`` re-posts
the held slot before waiting, and ``post_recv`` raises once the goodbye arrived).
"""

from __future__ import annotations

import collections
import os
from typing import TYPE_CHECKING

from tensorwire.benchmark.backends.base import PairContext, Prepare
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender
from tensorwire.benchmark.worker import recv_slots
from tensorwire.settings import env_var

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.p2p.link import Link

    from tensorwire.p2p.node import Node


def _node(ctx: PairContext, transport: str) -> "Node":
    from tensorwire.p2p.node import Node

    if transport == "tcp-stream":
        os.environ[env_var("cma")] = "off"  # this worker process only: it runs this one backend
        transport = "tcp"

    return Node(
        rank=ctx.rank,
        world_size=2,
        store=ctx.store,
        host=ctx.cfg.host,
        transport=transport,  # type: ignore[arg-type]
        timeout=ctx.timeout,
        prefix=ctx.key("tw/"),
        device=ctx.device if ctx.device.type == "cuda" else None,
    )


def _specs(size: int, ctx: PairContext):
    from tensorwire.spec import TensorSpec

    return (TensorSpec("data", (size,), "uint8", ctx.device.type), TensorSpec("ack", (1,), "uint8", "cpu"))


def _transport(arg: str | None) -> str:
    return (arg or "auto").removesuffix("-isend4").removesuffix("-isend")


def _window(arg: str | None) -> int:
    """Messages in flight through Link.isend (0: blocking send); the receiver posts that many slots (at least 2)."""
    a = arg or ""
    return 4 if a.endswith("-isend4") else 2 if a.endswith("-isend") else 0


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.node = _node(ctx, _transport(arg))
        self.link: "Link | None" = None
        self.src: "torch.Tensor | None" = None
        # "-isend" / "-isend4": sends go through Link.isend with this many in flight (the receiver's slots per name)
        self.window = _window(arg)
        self.inflight: collections.deque = collections.deque()

    def open(self, size: int, src: "torch.Tensor") -> None:
        data, ack = _specs(size, self.ctx)
        self.link = self.node.link(1, send=[data], recv=[ack], name=f"bench-{size}")
        self.transport = self.link.transport
        self.src = src

    def send(self) -> None:
        assert self.link is not None
        if not self.window:
            self.link.send("data", self.src)
            return
        if len(self.inflight) >= self.window:
            self.inflight.popleft().wait()
        self.inflight.append(self.link.isend("data", self.src))

    def wait_ack(self) -> None:
        assert self.link is not None
        while self.inflight:
            self.inflight.popleft().wait()
        self.link.recv("ack")

    def run_uni(self, n: int, prepare: "Prepare") -> None:
        if self.window and getattr(prepare, "__name__", "") != "noop":
            # --check: prepare() rewrites the source in place (the sequence stamp), so no message may still
            # be reading it: one in flight at a time (the figures of a --check run are not the point).
            for _ in range(n):
                while self.inflight:
                    self.inflight.popleft().wait()
                prepare()
                self.send()
            self.wait_ack()
            return
        super().run_uni(n, prepare)

    def close_size(self) -> None:
        if self.link is not None:
            self.ctx.publish(f"tw/done/{self.link.name}", "1")  # the receiver closes only after this
            self.link.close()
            self.link = None

    def close(self) -> None:
        self.close_size()
        self.node.close()


class Receiver(_Receiver):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        import torch

        self.node = _node(ctx, _transport(arg))
        self.link: "Link | None" = None
        self.ack_t = torch.ones(1, dtype=torch.uint8)
        self.depth = max(recv_slots("tensorwire"), _window(arg))  # (as the demo's receiver: recv_slots)

    def open(self, size: int) -> None:
        data, ack = _specs(size, self.ctx)
        self.link = self.node.link(0, send=[ack], recv=[data], name=f"bench-{size}", depth=self.depth)

    def recv(self) -> "torch.Tensor":
        assert self.link is not None
        return self.link.recv("data")

    def ack(self) -> None:
        assert self.link is not None
        self.link.send("ack", self.ack_t)

    def close_size(self) -> None:
        if self.link is not None:
            # Closing first would race the sender's last recv of the ack (the peer's goodbye can
            # overtake it): wait until the sender is done with this link.
            self.ctx.lookup(f"tw/done/{self.link.name}")
            self.link.close()
            self.link = None

    def close(self) -> None:
        self.close_size()
        self.node.close()
