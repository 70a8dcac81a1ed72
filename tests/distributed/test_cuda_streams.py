"""NCCL's CUDA stream semantics for backend "tensorwire", on a real GPU (two processes sharing cuda:0).

Skipped without CUDA; on a GPU host: ``pytest -m gpu tests/distributed``. The same logic is checked without a
GPU, with a stream simulator, in ``tests/distributed/test_streams.py``.

- a kernel writes the tensor right before ``isend`` and the receiver gets those bytes; the sender overwrites
  it right after ``wait()`` without harm; the receiver's earlier reader sees the old bytes and its consumer
  right after ``wait()`` the new ones (contiguous and strided receives, UCX and TCP);
- the host time of ``wait()`` for a 256 MiB receive is a small fraction of the time until its bytes are
  consumed (and, with ``TENSORWIRE_CUDA_STREAM_WAIT=0``, all of it: the measure tells the two apart);
- a peer killed while a stream waits for its bytes: the stream goes on, the Work reports ``PeerLost``, the
  group's next call raises.
"""

from __future__ import annotations

import importlib.util

import pytest

import cuda_workers as C
from harness import run_ranks

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
TRANSPORTS = [pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")), "tcp"]

#: Measured on an H100 (2026-11-24): with the stream-ordered wait, receives over TCP and strided receives over
#: UCX never completed (the receiver's wait timed out after 60 s); contiguous UCX receives passed. The mode is
#: therefore off by default (``TENSORWIRE_CUDA_STREAM_WAIT``); these cases stay, expected to fail, until fixed.
STREAM_WAIT_BROKEN = pytest.mark.xfail(
    reason="stream-ordered wait: TCP and strided receives never complete on an H100", strict=False
)


@pytest.mark.timeout(240)
@STREAM_WAIT_BROKEN
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kernel_before_isend_and_kernel_after_wait_see_the_right_bytes(transport, layout):
    res = run_ranks(C.ordered, 2, timeout=200, transport=transport, layout=layout)
    print(
        f"[{transport}, {layout}] wait() host times (us): send {[round(t * 1e6) for t in res[0]['wait_s']]}, "
        f"recv {[round(t * 1e6) for t in res[1]['wait_s']]}"
    )
    for rank in (0, 1):
        assert all(res[rank]["streamed"]), res[rank]  # every wait() returned before its operation completed
        # wait() only queued a stream wait: far below the ~tens of ms of GPU work queued ahead of the bytes
        assert max(res[rank]["wait_s"]) < 0.01, res[rank]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "stream_wait", [pytest.param(True, marks=STREAM_WAIT_BROKEN), False], ids=["stream-wait", "blocking"]
)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_host_time_of_wait_for_a_large_cuda_receive(transport, stream_wait):
    res = run_ranks(C.wait_latency, 2, timeout=200, transport=transport, stream_wait=stream_wait)[1]
    late, now = res["late"], res["now"]
    for label, r in (("sender 0.3 s late", late), ("256 MiB at once", now)):
        print(  # shown with pytest -s: the figures behind the assertions
            f"[{transport}, {'stream-wait' if stream_wait else 'blocking'}] {label}: wait() {r['wait_s'] * 1e6:.0f} us "
            f"on the host, bytes consumed after {r['total_s'] * 1e3:.2f} ms"
        )
    assert late["total_s"] > 0.25, res  # the sender sent 0.3 s after the receiver's wait()
    if stream_wait:
        assert late["streamed"] and now["streamed"], res
        assert late["wait_s"] < 0.05 * late["total_s"], res  # microseconds, not the 0.3 s until the bytes came
        assert now["wait_s"] < 0.5 * now["total_s"], res  # the transfer alone, 256 MiB
    else:
        assert not late["streamed"], res
        assert late["wait_s"] > 0.8 * late["total_s"], res  # blocking: wait() returns with the bytes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_receive_releases_the_stream_and_raises(transport):
    res = run_ranks(C.killed_mid_receive, 2, timeout=150, expect_fail=True, transport=transport)
    assert res[0][0] == "died"
    r = res[1]
    assert isinstance(r, dict), r
    assert r["streamed"] and r["wait_s"] < 0.05, r
    assert r["stream_released"] and r["released_after_s"] < 15, r
    assert r["completed"] and r["exception"] == "PeerLost" and r["is_dist_backend_error"], r
    assert r["next_irecv"] == "PeerLost" and r["next_barrier"] == "PeerLost", r
