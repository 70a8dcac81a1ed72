"""GroupWatch (the backend's hooks) with stand-in tensors and the backend's own Work: paths, relabelling,
fallbacks, errors and completions counted later."""

from __future__ import annotations

import pytest

from tensorwire import observe
from tensorwire.distributed.work import Work
from tensorwire.errors import PeerLostError
from tensorwire.observe import GroupWatch

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
    observe.reset()
    observe.set_enabled(True)
    yield
    observe.reset()


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
