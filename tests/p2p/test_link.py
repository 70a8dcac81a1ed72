"""Two real processes on loopback, both transports: the Link contract end to end."""

from __future__ import annotations

import importlib.util

import pytest

from harness import run_ranks
import workers

TRANSPORTS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("tensorwire.transport.ucx") is None or importlib.util.find_spec("ucxx") is None,
            reason="UCX transport not available",
        ),
    ),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype_and_edge_shape_round_trips_bit_exact(transport):
    res = run_ranks(workers.all_dtypes_and_shapes, transport=transport, timeout=200)
    assert res[0]["transport"] == transport
    assert res[0]["bad"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_non_contiguous_tensors_are_sent_correctly(transport):
    res = run_ranks(workers.non_contiguous, transport=transport)
    assert res[1] == res[0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_1000_steps_both_directions_at_once_are_bit_exact(transport):
    res = run_ranks(workers.many_steps_both_directions, transport=transport, timeout=200)
    assert res == {0: 0, 1: 0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_negotiation_mismatch_fails_on_both_sides_naming_the_tensor(transport):
    res = run_ranks(workers.mismatch, transport=transport, expect_fail=True)
    for rank in (0, 1):
        status, etype, message = res[rank]
        assert etype == "ShapeMismatchError", res[rank]
        assert "x: sender declares float32[4, 4] on cpu, receiver expects float32[4, 5] on cpu" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wrong_tensor_at_send_raises_sends_nothing_and_link_stays_usable(transport):
    res = run_ranks(workers.wrong_tensor_at_send, transport=transport)
    errors = res[0]
    assert len(errors) == 4
    assert "x: got shape (2, 3)" in errors[0]
    assert "float64" in errors[1]
    assert "'nope' was not declared" in errors[3]
    first, extra = res[1]
    assert first == [[7.0, 7.0], [7.0, 7.0]]
    assert extra == "timeout"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_stream_raises_peer_lost_within_timeout(transport):
    res = run_ranks(workers.peer_killed, transport=transport, expect_fail=True, timeout=60)
    etype, elapsed, message = res[0]
    assert etype == "PeerLostError", res[0]
    assert elapsed < 10.0
    # rank 1 killed itself: the harness reports it as missing/failed, never as a hang
    assert res[1] != "ok"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_1000_steps_of_1mib_allocate_no_new_memory_after_the_first(transport):
    res = run_ranks(workers.memory_after_first_step, transport=transport, timeout=150)
    for rank, r in res.items():
        assert not r["slots_moved"]
        assert r["rss_growth"] < 256 << 10, (rank, r)  # < 1/4 of one message: nothing per step
        assert r["py_growth"] < 64 << 10, (rank, r)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dynamic_dims_travel_with_each_message_and_overflow_is_an_error(transport):
    res = run_ranks(workers.dynamic_shapes, transport=transport)
    assert res[1] == [((16, 8), 16.0 * 128), ((3, 8), 3.0 * 24), ((1, 8), 8.0), ((0, 8), 0.0), ((9, 8), 9.0 * 72)]
    assert "larger than its declared maximum 16" in res[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_isend_handles_and_recv_into_out(transport):
    res = run_ranks(workers.isend_and_out, transport=transport)
    assert res[1] == [0, 1, 2, 3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_isends_posted_here_and_on_the_link_thread_keep_order_and_respect_credits(transport):
    res = run_ranks(workers.isend_mixed_paths, transport=transport)
    assert res[1][:12] == [float(k) for k in range(12)], res[1]
    if transport == "ucx":
        # 100 fits the slot the receiver still had posted; 101 finds no credit within 0.5 s and isend itself
        # refuses it, nothing sent; the 102 sent after it is the next message the receiver gets.
        assert res[0] == ("timed_out", True) and res[1][12:] == [100.0, 102.0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_relinking_the_same_peer_and_name_after_close_works(transport):
    res = run_ranks(workers.relink_same_name, transport=transport)
    assert res[0] == [10, 11, 12] and res[1] == [0, 1, 2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_depth_gives_a_name_more_slots_that_outlive_later_recvs(transport):
    res = run_ranks(workers.deep_slots, transport=transport)
    assert tuple(res[1]["depth"]) == (4, 2)
    assert res[1]["bad"] == []
    assert res[1]["b"] == [0.0, 1.0]
    assert res[0] == "timeout"  # default depth: the third message waits for the receiver


@pytest.mark.timeout(120)
def test_small_messages_go_ahead_of_their_slots_into_eager_buffers_over_tcp_then_wait():
    from tensorwire.p2p.link import EAGER_SLOTS

    res = run_ranks(workers.eager_ahead, transport="tcp")
    assert EAGER_SLOTS <= res[0] <= EAGER_SLOTS + 2  # then one waited for its credit (and timed out)
    assert res[1] == [float(i) for i in range(res[0])]


@pytest.mark.timeout(60)
def test_bad_depth_is_refused_before_anything_is_negotiated():
    res = run_ranks(workers.bad_depth, transport="tcp")
    for rank in (0, 1):
        errs = res[rank]
        assert len(errs) == 5 and not any("accepted" in e for e in errs), errs
        assert "must be an int in [2, 64]" in errs[0] and "'nope'" in errs[4]


def test_isend_handle_reports_the_sends_own_error_not_a_wait_timeout():
    """A send on the link's thread that failed with TransferTimeout (a TimeoutError, as the futures' own
    timeout is) must reach wait() as itself -- it used to be reported as "not complete within None s"."""
    import concurrent.futures

    from tensorwire.errors import TransferTimeout
    from tensorwire.p2p.link import SendHandle

    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(TransferTimeout("no credit to send on tag 3 within 60s"))
    with pytest.raises(TransferTimeout, match="no credit to send on tag 3 within 60s"):
        SendHandle(failed, "x").wait()
    pending: concurrent.futures.Future = concurrent.futures.Future()
    with pytest.raises(TransferTimeout, match="isend of 'x' not complete within 0.01s"):
        SendHandle(pending, "x").wait(0.01)
