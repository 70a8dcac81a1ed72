"""The request thread's short way for a plain posted get_rows (tensorwire.serve.daemon.datapath_fast): taken where it
applies, bit-exact, counted as the usual way counts, and every case it does not take answered the usual way."""

from __future__ import annotations

import time

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.daemon import datapath, datapath_reads

from serve_common import in_process

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="tcp", max_bytes="256MiB", metrics_port=0) as s:
        yield s


@pytest.fixture
def taken(monkeypatch):
    """What each call of the short way returned (True: it answered the request)."""
    seen: list[bool] = []
    real = datapath.fast_get_rows

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        seen.append(got)
        return got

    monkeypatch.setattr(datapath, "fast_get_rows", spy)
    return seen


def _settle(seen: list, n: int) -> None:
    """Until ``seen`` holds ``n`` results: the short way returns only after its reply is out, so a client may
    read that reply (and go on) a moment before the spy has the result."""
    end = time.monotonic() + 10
    while len(seen) < n and time.monotonic() < end:
        time.sleep(0.002)


def _session(srv, c):
    (session,) = [x for x in srv.service.sessions() if x.id == c._sid]
    return session


def test_a_plain_posted_get_rows_is_answered_in_the_request_thread_bit_exact(srv, taken):
    g = torch.Generator().manual_seed(5)
    with Client(srv.address, transport="tcp") as c:
        for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool):
            tab = (torch.rand(3000, 7, 3, generator=g) * 200).to(dtype)
            name = f"fast/{dtype}"
            c.put(name, tab)
            k = len(taken)  # (a put's requests are declined before their replies: all there)
            c.get_rows(name, [0])  # the client learns the spec: its next reads are posted
            _settle(taken, k + 1)
            taken.clear()
            s = _session(srv, c)
            d0, r0 = s._down_step, s._reply_step
            for n in (1, 2, 257, 3000):
                idx = torch.randint(0, 3000, (n,), generator=g)
                out = torch.empty(n, 7, 3, dtype=dtype)
                assert c.get_rows(name, idx, out=out) is out
                assert torch.equal(out, tab[idx]), (dtype, n)
            assert torch.equal(c.get_rows(name, [2999, 0, 2999]), tab[[2999, 0, 2999]])
            _settle(taken, 5)
            assert taken == [True] * 5, (dtype, taken)
            # each read took one step on each tag, as its job would have: one reply and one message of rows
            assert (s._down_step - d0, s._reply_step - r0) == (5, 5)
            assert s.active == 0
            c.delete(name)


def test_the_short_way_counts_the_read_in_the_metrics(srv, taken):
    with Client(srv.address, transport="tcp") as c:
        c.put("fast/metrics", torch.arange(40.0).view(10, 4))
        k = len(taken)
        c.get_rows("fast/metrics", [1])
        _settle(taken, k + 1)
        s = _session(srv, c)
        assert s.tally is not None
        before = s.tally.ops.get(("GetRows", "ok"), [0])[0]
        moved0 = s.tally.transfers.get(("tcp", "out"), [0, 0])[1]
        taken.clear()
        for _ in range(3):
            assert c.get_rows("fast/metrics", [9]).tolist() == [[36.0, 37.0, 38.0, 39.0]]
        _settle(taken, 3)  # (the tally is written before the result)
        assert taken == [True] * 3
        ok = s.tally.ops[("GetRows", "ok")][0] - before
        moved = s.tally.transfers[("tcp", "out")][1] - moved0
        assert ok == 3 and moved == 3 * 16  # three reads, 16 bytes of rows each
        c.delete("fast/metrics")


def test_what_the_short_way_does_not_take_goes_the_usual_way(srv, taken, monkeypatch):
    with Client(srv.address, transport="tcp") as c:
        tab = torch.arange(60.0).view(20, 3)
        c.put("fast/other", tab)
        k = len(taken)
        c.get_rows("fast/other", [0])
        _settle(taken, k + 1)
        taken.clear()
        with pytest.raises(tw.SpecError, match="out of range"):  # answered with the usual error, nothing sent
            c.get_rows("fast/other", [3, 20])
        with pytest.raises(tw.SpecError, match="out of range"):
            c.get_rows("fast/other", [-1])
        assert taken == [False, False]
        assert torch.equal(c.get_rows("fast/other", [19, 3]), tab[[19, 3]])  # the session goes on
        _settle(taken, 3)
        assert taken == [False, False, True]
        # a spec changed under the client: it posted for the old shape, the daemon sends what it holds
        c2 = Client(srv.address, transport="tcp")
        try:
            c2.delete("fast/other")
            c2.put("fast/other", torch.ones(20, 5, dtype=torch.float64))
        finally:
            c2.close()
        taken.clear()
        got = c.get_rows("fast/other", [4])
        assert got.dtype == torch.float64 and got.shape == (1, 5) and bool((got == 1).all())
        assert taken == [False]
        # rows two threads gather: the usual way
        monkeypatch.setattr(datapath_reads, "PARALLEL_MIN_BYTES", 64)
        taken.clear()
        assert c.get_rows("fast/other", [1, 2, 3]).shape == (3, 5)
        assert taken == [False]
        # a get is never the short way's
        taken.clear()
        assert c.get("fast/other").shape == (20, 5)
        assert taken == [False]
        c.delete("fast/other")


def test_views_made_once_follow_the_row_buffer_when_it_grows(srv, taken):
    """The short way keeps its index and destination views per read; a read that grows the session's row buffer
    must leave no view of the old one in use (the same small read before and after, bit-exact)."""
    g = torch.Generator().manual_seed(9)
    tab = torch.randn(40_000, 64, generator=g)  # 256-byte rows
    with Client(srv.address, transport="tcp") as c:
        c.put("fast/grow", tab)
        c.get_rows("fast/grow", [0])
        s = _session(srv, c)
        small = torch.tensor([7, 39_999, 3])
        assert torch.equal(c.get_rows("fast/grow", small), tab[small])
        before = s._scratch
        big = torch.randint(0, 40_000, (20_000,), generator=g)  # 5 MB: more than the buffer held
        assert torch.equal(c.get_rows("fast/grow", big), tab[big])
        assert s._scratch is not before  # it grew
        for _ in range(3):
            assert torch.equal(c.get_rows("fast/grow", small), tab[small])
        c.put("fast/grow", tab * 2)  # a new version: the same views, other bytes
        assert torch.equal(c.get_rows("fast/grow", small), (tab * 2)[small])
        c.delete("fast/grow")


def test_an_index_out_of_range_is_refused_at_every_size(srv):
    with Client(srv.address, transport="tcp") as c:
        c.put("fast/range", torch.zeros(100, 4))
        c.get_rows("fast/range", [0])
        for idx in ([100], [0, -1], list(range(20)) + [100], [-5] * 17):
            with pytest.raises(tw.SpecError, match="out of range"):
                c.get_rows("fast/range", idx)
        assert torch.equal(c.get_rows("fast/range", [99, 0]), torch.zeros(2, 4))
        c.delete("fast/range")
