"""GroupWatch (the backend's hooks) with stand-in tensors and the backend's own Work: paths, relabelling,
fallbacks, errors and completions counted later."""

from __future__ import annotations

import time

import pytest

from tensorwire import observe
from tensorwire.distributed.work import Work
from tensorwire.errors import PeerLostError
from tensorwire.observe import GroupWatch
from tensorwire.observe.registry import SWITCH, Flow

pytestmark = pytest.mark.timeout(30)


class _Transport:
    def __init__(self, kind: str, reaches_cuda: bool) -> None:
        self.kind = kind
        self.reaches_cuda = reaches_cuda
        self.cma = None


class _Tensor:
    def __init__(self, nbytes: int, *, cuda: bool) -> None:
        self.nbytes = nbytes
        self.is_cuda = cuda


@pytest.fixture(autouse=True)
def _fresh():
    """Counts reset around each test, every message timed (a test of the sample sets its own rate)."""
    observe.reset()
    observe.set_enabled(True)
    every = observe.sample_every()
    observe.set_sample_every(1)
    yield
    observe.reset()
    observe.set_sample_every(every)


def _flows() -> dict[tuple[str, str, str], dict]:
    return {(f["peer"], f["path"], f["direction"]): f for f in observe.metrics()["flows"]}


def test_host_and_cuda_tensors_count_under_their_paths_and_relabelling_moves_cuda_to_ce():
    done = []

    def send(tensors, peer, tag):
        w = Work(10.0, tensors)
        w._finish()
        done.append(w)
        return w

    gw = GroupWatch({1: _Transport("ucx", True), 2: _Transport("tcp", False)}, do_send=send, do_recv=send)
    gw.send([_Tensor(4096, cuda=False)], 1, 0)
    gw.send([_Tensor(1 << 20, cuda=True)], 1, 0)
    gw.send([_Tensor(1 << 20, cuda=True)], 2, 0)
    gw.send([_Tensor(1 << 20, cuda=True)], 2, 0)
    gw.set_path(1, cuda="ce")
    gw.recv([_Tensor(1 << 20, cuda=True)], 1, 0)
    flows = _flows()
    assert flows[("1", "ucx", "send")]["messages"] == 2
    assert flows[("1", "ucx", "send")]["bytes"] == 4096 + (1 << 20)
    assert flows[("2", "staged", "send")]["messages"] == 2
    assert flows[("1", "ce", "recv")]["messages"] == 1 and flows[("1", "ce", "recv")]["completed"] == 1
    # the staged path of peer 2 is a fallback, counted once however many messages take it
    assert observe.metrics()["fallbacks"] == [
        {"peer": "2", "wanted": "ucx", "taken": "staged", "reason": "tcp_cannot_reach_cuda", "count": 1}
    ]


def test_a_work_completing_later_counts_its_post_now_and_its_completion_then():
    pending: list[Work] = []

    def send(tensors, peer, tag):
        w = Work(10.0, tensors)
        pending.append(w)
        return w

    gw = GroupWatch({1: _Transport("tcp", False)}, do_send=send, do_recv=send)
    gw.send([_Tensor(4096, cuda=False)], 1, 0)
    gw.send([_Tensor(4096, cuda=False)], 1, 0)
    f = _flows()[("1", "tcp", "send")]
    assert f["messages"] == 2 and f["completed"] == 0 and sum(f["call_buckets"]) == 2
    pending[0]._finish()
    pending[1]._finish(PeerLostError("rank 1 went away"))
    f = _flows()[("1", "tcp", "send")]
    assert f["completed"] == 2 and sum(f["completion_buckets"]) == 2
    assert observe.metrics()["errors"] == [{"peer": "1", "path": "tcp", "kind": "PeerLostError", "count": 1}]
    pending[0]._finish()  # a second finish changes nothing
    assert _flows()[("1", "tcp", "send")]["completed"] == 2


def test_a_call_that_raises_counts_an_error_and_no_message():
    def refuse(tensors, peer, tag):
        raise PeerLostError("gone")

    gw = GroupWatch({1: _Transport("tcp", False)}, do_send=refuse, do_recv=refuse)
    with pytest.raises(PeerLostError):
        gw.recv([_Tensor(8, cuda=False)], 1, 0)
    assert observe.metrics()["totals"]["recv"]["messages"] == 0
    assert observe.metrics()["errors"] == [{"peer": "1", "path": "tcp", "kind": "PeerLostError", "count": 1}]


def test_unknown_peers_and_several_tensors_go_to_the_group_uncounted_so_it_raises_its_own_error():
    seen = []

    def send(tensors, peer, tag):
        seen.append((len(tensors), peer))
        raise ValueError("the group's own error")

    gw = GroupWatch({1: _Transport("tcp", False)}, do_send=send, do_recv=send)
    with pytest.raises(ValueError, match="own error"):
        gw.send([_Tensor(8, cuda=False)], 7, 0)
    with pytest.raises(ValueError, match="own error"):
        gw.send([_Tensor(8, cuda=False), _Tensor(8, cuda=False)], 1, 0)
    assert seen == [(1, 7), (2, 1)]
    assert observe.metrics()["errors"] == []


def test_one_message_in_n_is_timed_and_every_message_error_and_completion_is_counted():
    """TENSORWIRE_METRICS_SAMPLE: the histograms hold the first message of a route and each n-th one after it;
    messages, bytes, completions and errors count all of them, timed or not."""
    observe.set_sample_every(4)
    pending: list[Work] = []

    def send(tensors, peer, tag):  # completes in the call
        w = Work(10.0, tensors)
        w._finish()
        return w

    def recv(tensors, peer, tag):  # completes later
        w = Work(10.0, tensors)
        pending.append(w)
        return w

    gw = GroupWatch({1: _Transport("tcp", False)}, do_send=send, do_recv=recv, cuda=False)
    for _ in range(10):
        gw.send([_Tensor(100, cuda=False)], 1, 0)
        gw.recv([_Tensor(100, cuda=False)], 1, 0)
    sent, got = _flows()[("1", "tcp", "send")], _flows()[("1", "tcp", "recv")]
    # messages 1, 5 and 9 of each route are timed
    assert sent["messages"] == 10 and sent["bytes"] == 1000 and sent["completed"] == 10 and sent["timed"] == 3
    assert sum(sent["call_buckets"]) == sum(sent["completion_buckets"]) == 3
    assert got["messages"] == 10 and got["completed"] == 0 and got["timed"] == 3
    assert sum(got["call_buckets"]) == 3 and sum(got["completion_buckets"]) == 0
    for w in pending[:-1]:
        w._finish()
    pending[-1]._finish(PeerLostError("rank 1 went away"))  # the 10th: not timed, its failure still counted
    got = _flows()[("1", "tcp", "recv")]
    assert got["completed"] == 10 and sum(got["completion_buckets"]) == 3 and got["completion_seconds"] > 0
    assert observe.metrics()["errors"] == [{"peer": "1", "path": "tcp", "kind": "PeerLostError", "count": 1}]


def test_a_work_completed_by_another_thread_around_its_watch_is_counted_once():
    """Work.watch takes no lock: a work that completes before, during or after the watch's stores is counted
    once, by whichever of watch and _finish takes its flow."""
    errors: list[BaseException] = []
    t0 = time.perf_counter_ns()
    for timed in (0, t0):
        flow = Flow("1", "tcp", "recv")
        # watched, then completed: _finish counts it
        w = Work(10.0, [])
        flow.open += 1
        w.watch(flow, timed, errors.append)
        w._finish(PeerLostError("gone"))
        w._finish()
        assert flow.open == 0 and len(errors) == 1
        # completed before the stores: the watch sees it done and counts it
        w = Work(10.0, [])
        w._finish(PeerLostError("gone"))
        flow.open += 1
        w.watch(flow, timed, errors.append)
        assert flow.open == 0 and len(errors) == 2
        # completed between the stores and the watch's look (it took the flow): the watch counts nothing more
        w = Work(10.0, [])
        flow.open += 1
        w._t0, w._on_error, w._flow = timed, errors.append, flow
        w._finish()
        w._watched_late(flow)
        assert flow.open == 0 and len(errors) == 2
        assert sum(flow.done) == (3 if timed else 0)
        errors.clear()


def test_the_settings_are_read_when_the_first_hooks_are_made(monkeypatch):
    """TENSORWIRE_METRICS=0 stops the hooks from the start (not only once something asked tw.metrics()), and
    TENSORWIRE_METRICS_SAMPLE sets the rate."""
    monkeypatch.setenv("TENSORWIRE_METRICS", "0")
    monkeypatch.setenv("TENSORWIRE_METRICS_SAMPLE", "5")
    monkeypatch.setattr(SWITCH, "_read", False)
    monkeypatch.setattr(SWITCH, "on", True)
    try:
        gw = GroupWatch(
            {1: _Transport("tcp", False)},
            do_send=lambda ts, p, tag: Work(1.0, ts),
            do_recv=lambda ts, p, tag: Work(1.0, ts),
        )
        gw.send([_Tensor(8, cuda=False)], 1, 0)
        assert observe.metrics()["totals"]["send"]["messages"] == 0 and observe.metrics()["enabled"] is False
        assert observe.sample_every() == 5
    finally:
        observe.set_enabled(True)
