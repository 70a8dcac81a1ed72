"""A Link's copy-engine send and receive paths (tensorwire.p2p.ce_paths) against the stream simulator, on CPU.

The receiver's slots are host tensors here, each registered with the simulator as an allocation it can
"export"; the sender's tensor is a CPU tensor presented as a CUDA one (the paths only ask it for its shape,
dtype, device index, contiguity and address). The callers' streams are the simulator's.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tensorwire.errors import PeerLostError
from tensorwire.p2p import ce_paths
from tensorwire.p2p.ce_paths import CeRecv, CeSend
from tensorwire.spec import TensorSpec
from tensorwire.transport.ce import CePair, Region

from ce_sim import SimDriver

pytestmark = pytest.mark.timeout(60)


class LinkSim(SimDriver):
    """The simulator, where any host tensor's memory can be looked up and exported (the slots are made by the
    paths themselves, not by :meth:`SimDriver.alloc`)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        try:
            return super().allocation(ptr)
        except Exception:  # noqa: BLE001 - a slot: its own allocation
            self.allocs.append((ptr, 1 << 20, ptr, True, None))  # type: ignore[arg-type]
            return ptr, 1 << 20, ptr

    def wait(self, stream: int, addr: int, value: int) -> None:
        self.waits += 1
        super().wait(stream, addr, value)


class AsCuda:
    """A CPU tensor as the send path sees a CUDA one."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype, self.is_cuda = t, t.shape, t.dtype, True
        self.device = SimpleNamespace(index=0)

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.t.data_ptr()


@pytest.fixture
def link(tmp_path, monkeypatch):
    sim = LinkSim()
    ra = Region.create(str(tmp_path))
    rb = Region.attach(ra.path)

    def mismatch(mine, theirs, sending):
        return None

    a = CePair(ra, rank=0, peer=1, timeout=10.0, driver=sim, mismatch=mismatch)
    b = CePair(rb, rank=1, peer=0, timeout=10.0, driver=sim, mismatch=mismatch)
    streams = {"a": sim.new_stream(), "b": sim.new_stream()}
    current = {"stream": streams["a"]}
    monkeypatch.setattr(ce_paths, "current_raw_stream", lambda device: current["stream"])
    spec = TensorSpec("x", (64,), "float32", "cpu")  # (host slots: the simulator's memory)
    recv = CeRecv(spec, 3, b, device="cpu", depth=2)
    send = CeSend(TensorSpec("x", (64,), "float32", "cuda"), 3, a)
    yield SimpleNamespace(sim=sim, send=send, recv=recv, streams=streams, current=current)
    a.close(PeerLostError("test over"))
    b.close(PeerLostError("test over"))
    sim.stop()


def _drain(sim: SimDriver) -> None:
    for s in sim.streams.values():
        assert s.drain(), "a simulated stream never finished its work"
        assert not s.hung, "a simulated stream waited on a flag that never came"


def _send(link, t: torch.Tensor) -> None:
    link.current["stream"] = link.streams["a"]
    link.send.send(AsCuda(t), 10.0)


def _recv(link) -> torch.Tensor:
    link.current["stream"] = link.streams["b"]
    return link.recv.recv(None, 10.0)


def test_messages_arrive_and_met_flags_queue_no_gpu_wait(link):
    """A send whose slot the host already sees freed, and a receive whose message the host already sees in
    place, queue no flag wait on their streams; the bytes arrive in order either way."""
    for i in range(6):
        src = torch.arange(64, dtype=torch.float32) + 100 * i
        _send(link, src)
        _drain(link.sim)  # (the copy and its flag ran: the receiver finds the message in place)
        waits = link.sim.waits
        got = _recv(link)
        _drain(link.sim)
        assert link.sim.waits == waits  # its message was in place: no wait queued
        assert torch.equal(got, src)
    # the slots were freed long ago by the receiver's stream: no send waited on the GPU either
    assert link.sim.waits == 0


def test_a_send_into_a_slot_still_being_read_waits_for_the_receivers_stream(link):
    """The receiver's stream still reads a slot (work queued before its next receive): a send into that slot
    waits on the GPU for the receiver's free flag, so the slot is not overwritten under the reader."""
    first = torch.full((64,), 1.0)
    _send(link, first)
    _drain(link.sim)
    slot = _recv(link)  # message 1 in slot 0
    _drain(link.sim)
    gate, seen = threading.Event(), []
    # a "kernel" on the receiver's stream still reading slot 0, then the receiver's next receive (message 2)
    link.sim.streams[link.streams["b"]].put(lambda: (gate.wait(10), seen.append(float(slot.sum()))))
    second, third = torch.full((64,), 2.0), torch.full((64,), 3.0)  # (kept until their copies ran)
    _send(link, second)  # message 2 -> slot 1: freed already
    _recv(link)  # frees slot 0 for message 3 -- queued behind the reading "kernel"
    waits = link.sim.waits
    _send(link, third)  # message 3 -> slot 0, still being read
    assert link.sim.waits == waits + 1  # the host saw slot 0 not yet freed: a GPU wait was queued
    time.sleep(0.05)
    assert float(slot.sum()) == 64.0  # not overwritten while the reader runs
    gate.set()
    _drain(link.sim)
    assert seen == [64.0]
    assert torch.equal(_recv(link), third)
    _drain(link.sim)
