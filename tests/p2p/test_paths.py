"""The prepared send/receive paths of a Link: which path a spec gets, and that they agree on the wire."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from tensorwire.p2p.link import Link
from tensorwire.p2p.paths import (
    HostSend,
    IsendQueue,
    SendPath,
    SlotRecv,
    recv_path,
    send_path,
)
from tensorwire.spec import TensorSpec
from tensorwire.transport.base import new_nonce
from tensorwire.transport.memory import memory_pair

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
KINDS = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed"))]


def _no_staging() -> tuple[object, int]:
    raise AssertionError("host specs never stage")


def _closed_never() -> None:
    return None


def test_each_host_spec_gets_its_path_and_its_slots_posted() -> None:
    a, b = memory_pair()
    static = TensorSpec("w", (4, 4), "float32", "cpu")
    dynamic = TensorSpec("x", (8, 3), "float32", "cpu", dynamic=(True, False))
    q = IsendQueue(1, _closed_never)
    assert type(send_path(static, 0, a, q, device=None, staging=_no_staging, side=_no_staging)) is HostSend
    assert type(send_path(dynamic, 1, a, q, device=None, staging=_no_staging, side=_no_staging)) is SendPath
    rx = recv_path(static, 0, b, device=None, depth=3, staging=_no_staging, side=_no_staging)
    assert type(rx) is SlotRecv and rx.depth == 3 and len(rx.all_slots()) == 3
    a.close()
    b.close()


def _pair(kind: str):
    """(dialling side, accepting side, listener) of an in-process connection."""
    if kind == "tcp":
        from tensorwire.transport.tcp import TcpListener as L
    else:
        from tensorwire.transport.ucx import UcxListener as L  # type: ignore[assignment]
    lst = L()
    nonce = new_nonce()
    lst.expect(nonce)
    box: list = []
    th = threading.Thread(
        target=lambda: box.append(L.connect("127.0.0.1", lst.address[1], nonce, timeout=10)), daemon=True
    )
    th.start()
    server = lst.accept(nonce, timeout=10)
    th.join(10)
    assert box, "connect did not return"
    return box[0], server, lst


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_fast_and_general_sends_of_one_name_arrive_in_order(kind: str) -> None:
    """Contiguous tensors take the fast path, others the staging slot: one step sequence on the wire
    (the TCP transport checks it), every message bit-exact and in order, also for a dynamic spec."""
    ta, tb, lst = _pair(kind)
    static = TensorSpec("w", (4, 6), "float32", "cpu")
    dynamic = TensorSpec("d", (8, 6), "float32", "cpu", dynamic=(True, False))
    kw = {"name": "p", "timeout": 20.0, "device": None}
    sender = Link(node_rank=0, peer=1, transport=ta, send=[static, dynamic], recv=[], **kw)
    receiver = Link(node_rank=1, peer=0, transport=tb, send=[], recv=[static, dynamic], **kw)
    try:
        for k in range(12):
            base = torch.arange(24, dtype=torch.float32) + 100 * k
            w = base.view(4, 6) if k % 3 else base.view(6, 4).t()  # every third one is non-contiguous
            assert w.is_contiguous() == bool(k % 3)
            sender.send("w", w)
            assert torch.equal(receiver.recv("w"), w)
            rows = 1 + k % 8
            d = torch.arange(rows * 6, dtype=torch.float32).view(rows, 6) - k
            sender.send("d", d if k % 2 else d.t().contiguous().t())
            assert torch.equal(receiver.recv("d"), d)
        assert sender.bytes_sent == receiver.bytes_received > 0
    finally:
        sender.close()
        receiver.close()
        lst.close()
