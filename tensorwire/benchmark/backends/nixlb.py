"""NIXL (when importable): one-sided WRITE into the receiver's registered buffer, with a notification.

Each size registers fresh memory on both sides (the first transfer pays the
registration, as with tensorwire's fresh slots). The sender posts one prepared
WRITE per message (``transfer`` + poll ``check_xfer_state``); the receiver
counts the notifications that ride along and acknowledges with a notification
of its own. NIXL has no flow control: in the stream pattern WRITEs land back to
back in the one remote buffer (what the ANCHORS NIXL figure measures). With
``--check`` the receiver also says "free" after reading each message and the
sender waits for it before the next WRITE (without that, ``--check`` sees the
next message overwrite the one being checked). Agent metadata (again after each registration: it carries the remote keys) and buffer
addresses go through the runner's store.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from tensorwire.benchmark.backends.base import BackendUnavailable, PairContext, Prepare
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender

if TYPE_CHECKING:  # pragma: no cover
    import torch

_NAMES = ("tw-bench-sender", "tw-bench-receiver")


def _nixl_api() -> Any:
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            import importlib

            return importlib.import_module(mod)
        except ImportError:
            continue
    raise BackendUnavailable("nixl is not installed (pip install nixl)")


class _Agent:
    def __init__(self, ctx: PairContext) -> None:
        api = _nixl_api()
        self.ctx = ctx
        self.name = _NAMES[ctx.rank]
        self.peer_name = _NAMES[1 - ctx.rank]
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        ctx.publish(f"nixl/md/{ctx.rank}", self.agent.get_agent_metadata())
        peer_md = ctx.lookup(f"nixl/md/{1 - ctx.rank}")
        self.peer = self.agent.add_remote_agent(peer_md)
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()
        self.pending: dict[bytes, int] = {}
        self.mem = "VRAM" if ctx.device.type == "cuda" else "DRAM"
        self.dev = (ctx.device.index or 0) if ctx.device.type == "cuda" else 0

    def wait_notif(self, kind: bytes) -> None:
        """Wait for the next notification ``kind`` from the peer (d = data written, f = buffer free, a = ack)."""
        deadline = None
        while not self.pending.get(kind):
            notifs = self.agent.get_new_notifs()
            for name, msgs in notifs.items():
                if (name.decode() if isinstance(name, bytes) else name) == self.peer_name:
                    for m in msgs:
                        self.pending[bytes(m)] = self.pending.get(bytes(m), 0) + 1
            if not self.pending.get(kind):
                now = time.monotonic()
                deadline = deadline or now + self.ctx.timeout
                if now > deadline:
                    raise TimeoutError(f"no NIXL notification {kind!r} from {self.peer_name} in {self.ctx.timeout}s")
        self.pending[kind] -= 1


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.a = _Agent(ctx)
        self.reg: Any = None
        self.handle: Any = None

    def open(self, size: int, src: "torch.Tensor") -> None:
        ag = self.a.agent
        self.reg = ag.register_memory(src)
        remote_ptr, remote_dev = (int(x) for x in self.ctx.lookup(f"nixl/buf/{size}").split(b":"))
        # The receiver's new registration travels in its agent metadata: load it again.
        md = self.ctx.lookup(f"nixl/md/1/{size}")
        ag.remove_remote_agent(self.a.peer)
        peer = ag.add_remote_agent(md)
        self.a.peer = peer.decode() if isinstance(peer, bytes) else peer
        local = ag.get_xfer_descs([(src.data_ptr(), size, self.a.dev)], self.a.mem)
        remote = ag.get_xfer_descs([(remote_ptr, size, remote_dev)], self.a.mem)
        self.handle = ag.initialize_xfer("WRITE", local, remote, self.a.peer, b"d")
        if not self.handle:
            raise RuntimeError("nixl initialize_xfer failed")

    def send(self) -> None:
        ag = self.a.agent
        state = ag.transfer(self.handle)
        deadline = None
        while state != "DONE":
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed (ERR)")
            state = ag.check_xfer_state(self.handle)
            if deadline is None:
                deadline = time.monotonic() + self.ctx.timeout
            elif time.monotonic() > deadline:
                raise TimeoutError("NIXL transfer did not complete in time")

    def wait_ack(self) -> None:
        self.a.wait_notif(b"a")

    def run_uni(self, n: int, prepare: Prepare) -> None:
        if not self.ctx.cfg.check:
            super().run_uni(n, prepare)  # back-to-back WRITEs into the one remote buffer, as NIXL users do
            return
        for _ in range(n):  # --check: wait until the receiver has read each message before overwriting it
            prepare()
            self.send()
            self.a.wait_notif(b"f")
        self.wait_ack()

    def rtt_once(self, prepare: Prepare) -> None:
        prepare()
        self.send()
        if self.ctx.cfg.check:
            self.a.wait_notif(b"f")
        self.wait_ack()

    def close_size(self) -> None:
        if self.handle is not None:
            self.a.agent.release_xfer_handle(self.handle)
            self.handle = None
        if self.reg is not None:
            self.a.agent.deregister_memory(self.reg)
            self.reg = None


class Receiver(_Receiver):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.a = _Agent(ctx)
        self.buf: "torch.Tensor | None" = None
        self.reg: Any = None

    def open(self, size: int) -> None:
        import torch

        self.buf = torch.empty(size, dtype=torch.uint8, device=self.ctx.device)
        self.reg = self.a.agent.register_memory(self.buf)
        self.ctx.publish(f"nixl/md/1/{size}", self.a.agent.get_agent_metadata())
        self.ctx.publish(f"nixl/buf/{size}", f"{self.buf.data_ptr()}:{self.a.dev}")

    def recv(self) -> "torch.Tensor":
        self.a.wait_notif(b"d")
        assert self.buf is not None
        return self.buf

    def serve(self, steps, patterns, sink) -> None:
        if not self.ctx.cfg.check:
            super().serve(steps, patterns, sink)
            return

        class _Freeing:  # tell the sender each message was read (checked) before it may write the next
            def __init__(self, inner: Any, rx: "Receiver") -> None:
                self.inner, self.rx = inner, rx

            def got(self, size: int, t: Any) -> None:
                self.inner.got(size, t)
                self.rx.a.agent.send_notif(self.rx.a.peer, b"f")

        super().serve(steps, patterns, _Freeing(sink, self))  # type: ignore[arg-type]

    def ack(self) -> None:
        self.a.agent.send_notif(self.a.peer, b"a")

    def close_size(self) -> None:
        if self.reg is not None:
            self.a.agent.deregister_memory(self.reg)
            self.reg = None
        self.buf = None
