"""The two-sided interface every benchmark backend implements.

A backend is a pair of classes, one per process of the pair:

- :class:`Sender` (rank 0) sends the caller's buffer and waits for acks; the
  driver in :mod:`tensorwire.benchmark.worker` times it;
- :class:`Receiver` (rank 1) receives every message into memory it allocated
  in :meth:`Receiver.open` (once per size: the "fresh slot" of the first-transfer
  measurement), hands each one to the :class:`Sink` (which counts and, with
  ``--check``, verifies it) and acknowledges.

The default loops (:meth:`Sender.run_uni`, :meth:`Sender.rtt_once`,
:meth:`Receiver.serve`) are built from the primitives; a backend whose receiver
is a server (gRPC) or that can batch better overrides them.

Rendezvous between the two processes goes through the ``torch.distributed``
store the runner hosts (``ctx.store``, keys under ``ctx.prefix``).
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.benchmark.config import BenchConfig, Steps

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.benchmark.worker import Sink

__all__ = ["PairContext", "Sender", "Receiver", "BackendUnavailable", "store_wait_get"]

Prepare = Callable[[], None]


class BackendUnavailable(Exception):
    """The backend's dependency is missing here (reported as *skipped*, not failed)."""


@dataclasses.dataclass
class PairContext:
    """What a backend gets in each process of the pair."""

    rank: int
    cfg: BenchConfig
    store: Any  # torch.distributed.Store
    prefix: str
    device: "torch.device"
    backend: str

    @property
    def timeout(self) -> float:
        return self.cfg.op_timeout

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def publish(self, name: str, value: bytes | str) -> None:
        self.store.set(self.key(name), value)

    def lookup(self, name: str, timeout: float | None = None) -> bytes:
        return store_wait_get(self.store, self.key(name), self.timeout if timeout is None else timeout)


def store_wait_get(store: Any, key: str, timeout: float) -> bytes:
    from datetime import timedelta

    store.wait([key], timedelta(seconds=timeout))
    return store.get(key)


class Sender(abc.ABC):
    """Rank 0 of a pair: sends ``src`` and waits for acks."""

    #: Transport actually used (filled in by backends that choose, e.g. tensorwire under auto).
    transport: str | None = None

    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        self.ctx = ctx
        self.arg = arg

    @abc.abstractmethod
    def open(self, size: int, src: "torch.Tensor") -> None:
        """Prepare to send ``src`` (flat uint8 on the bench device) as messages of ``size`` bytes."""

    @abc.abstractmethod
    def send(self) -> None:
        """Send the current content of ``src`` once; return when it may be modified."""

    @abc.abstractmethod
    def wait_ack(self) -> None:
        """Wait for the receiver's acknowledgement."""

    def close_size(self) -> None:
        """Release what :meth:`open` allocated."""

    def close(self) -> None:
        """Tear down the connection."""

    def run_uni(self, n: int, prepare: Prepare) -> None:
        """``n`` sends back to back, then one ack."""
        for _ in range(n):
            prepare()
            self.send()
        self.wait_ack()

    def rtt_once(self, prepare: Prepare) -> None:
        """One message, then its ack."""
        prepare()
        self.send()
        self.wait_ack()


class Receiver(abc.ABC):
    """Rank 1 of a pair: receives into its own buffers and acknowledges."""

    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        self.ctx = ctx
        self.arg = arg

    @abc.abstractmethod
    def open(self, size: int) -> None:
        """Allocate (once) what messages of ``size`` bytes are received into."""

    @abc.abstractmethod
    def recv(self) -> "torch.Tensor":
        """Receive the next message; return the flat uint8 tensor holding it (valid until the next recv)."""

    @abc.abstractmethod
    def ack(self) -> None:
        """Send the small acknowledgement."""

    def close_size(self) -> None:
        """Release what :meth:`open` allocated."""

    def close(self) -> None:
        """Tear down the connection."""

    def serve(self, steps: list[Steps], patterns: tuple[str, ...], sink: "Sink") -> None:
        """Receive the whole plan (mirrors the sender's driver)."""
        for st in steps:
            self.open(st.size)
            for _ in range(1 + st.warmup):
                sink.got(st.size, self.recv())
                self.ack()
            for pattern in patterns:
                if pattern == "uni":
                    for _ in range(st.uni_reps):
                        for _ in range(st.uni_batch):
                            sink.got(st.size, self.recv())
                        self.ack()
                else:
                    for _ in range(st.rtt_iters):
                        sink.got(st.size, self.recv())
                        self.ack()
            self.close_size()


def deadline_after(seconds: float) -> float:
    return time.monotonic() + seconds
