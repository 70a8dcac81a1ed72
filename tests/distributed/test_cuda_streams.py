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

#: Measured on an H100 (2026-11-24), with TENSORWIRE_CUDA_STREAM_WAIT=1: GPU work that a thread of tensorwire's
#: queues while the caller's stream waits on a flag that thread releases may never run (a copy kernel never did; a
#: pinned-memory copy on a stream of its own now and then). tensorwire therefore queues no GPU work in its threads
#: for such operations (a send's copy into its slot goes on the caller's stream; a receive through a slot blocks
#: the host in wait()), and TCP passed 3 runs in 3. Over UCX, UCX's own GPU work stays: 1 MiB sends in both
#: directions at once (the end of ``ordered``) stalled in some runs. The mode stays off by default; the UCX cases
#: are expected to fail now and then.
UCX_STREAM_WAIT_FLAKY = pytest.mark.xfail(
    reason="stream-ordered wait over UCX: UCX's own GPU work may stall while a stream waits (H100)", strict=False
)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("ucx", marks=[UCX_STREAM_WAIT_FLAKY, pytest.mark.skipif(not HAVE_UCX, reason="no ucxx")]),
        "tcp",
        "ce",
    ],
)
def test_kernel_before_isend_and_kernel_after_wait_see_the_right_bytes(transport, layout):
    res = run_ranks(C.ordered, 2, timeout=200, transport=transport, layout=layout)
    print(
        f"[{transport}, {layout}] wait() host times (us): send {[round(t * 1e6) for t in res[0]['wait_s']]}, "
        f"recv {[round(t * 1e6) for t in res[1]['wait_s']]}"
    )
    # A receive through a slot (TCP's pinned one, a non-contiguous tensor's) blocks the host in wait(): the copy
    # out of the slot is GPU work of tensorwire's thread, which may never run while the stream waits on a flag.
    # Every other wait() only queues a stream wait.
    if transport == "ce":  # the copy-engine path: every wait() only queues a stream wait, staged or not (the
        # first message of the pair registers its shared memory, which may wait for the device: steps 1 and 2)
        for rank in (0, 1):
            assert all(res[rank]["streamed"][1:]) and max(res[rank]["wait_s"][1:]) < 0.01, res[rank]
        return
    direct = transport == "ucx" and layout == "contiguous"
    for rank in (0, 1) if direct else (0,):
        assert all(res[rank]["streamed"]), res[rank]  # every wait() returned before its operation completed
        # wait() only queued a stream wait: far below the ~tens of ms of GPU work queued ahead of the bytes
        assert max(res[rank]["wait_s"]) < 0.01, res[rank]
    if not direct:
        assert not any(res[1]["streamed"]), res[1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stream_wait", [True, False], ids=["stream-wait", "blocking"])
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
    if stream_wait and transport == "tcp":  # through a pinned slot: wait() blocks the host (see channel.py)
        assert not late["streamed"] and late["wait_s"] > 0.8 * late["total_s"], res
    elif stream_wait:
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
    if transport == "ucx":  # straight into the tensor: wait() only queued a stream wait
        assert r["streamed"] and r["wait_s"] < 0.05 and r["wait_raised"] is None, r
    else:  # through a pinned slot: wait() blocks the host, and raises within the peer timeout (5 s)
        assert not r["streamed"] and r["wait_raised"] == "PeerLost" and r["wait_s"] < 15, r
    assert r["stream_released"] and r["released_after_s"] < 15, r
    assert r["completed"] and r["exception"] == "PeerLost" and r["is_dist_backend_error"], r
    assert r["next_irecv"] == "PeerLost", r
    if transport == "ucx":  # the failure came after wait() returned: the group's next collective raises it too
        assert r["next_barrier"] == "PeerLost", r
