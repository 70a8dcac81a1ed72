"""get_rows into host memory from a read lease (tensorwire/serve/client/shm_rows.py): torch's own gather over a
typed view of the mapped slot, made once per lease, with the guarantees of the general lease path -- one whole
version, rows out of range refused before anything is written, a dead daemon's lease not used."""

from __future__ import annotations

import signal
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client import shm_maps, shm_rows
from tensorwire.serve.client.client import Client
from tensorwire.serve.client.gather_choice import GatherChoice
from tensorwire.serve.client.shm_path import leases_wanted as _leases_wanted

from serve_common import Daemon, in_process, shm_room

pytestmark = [
    pytest.mark.skipif(not shm_room(), reason="no /dev/shm here, or under 256 MiB free in it"),
    pytest.mark.skipif(not _leases_wanted(), reason="read leases are for x86 clients only"),
]


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="auto", max_bytes="1GiB") as s:
        yield s


@pytest.fixture(params=["torch", "numpy"])
def gather(request, monkeypatch):
    """Either way a lease gather goes: torch's index_select, or numpy's take where that was measured faster."""
    monkeypatch.setattr(shm_maps.Copier, "torch_gather", lambda self, nbytes: request.param == "torch")
    return request.param


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.uint8])
def test_lease_rows_are_the_rows_into_out_or_a_buffer_with_one_table_per_lease(srv, gather, dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(700, 3, 5, generator=g) * 50).to(dtype)
    name = f"lrows/{gather}/{dtype}"
    with Client(srv.address, transport="shm") as c:
        c.put(name, x)
        assert torch.equal(c.get_rows(name, [0]), x[[0]])  # a request: hands out the lease
        reads = c.lease_reads
        for idx in ([699], [0, 699, 0], torch.randint(0, 700, (500,), generator=g)):
            i = torch.as_tensor(idx, dtype=torch.int64)
            out = torch.empty(len(i), 3, 5, dtype=dtype)
            assert c.get_rows(name, i, out=out) is out and torch.equal(out, x[i])
            assert torch.equal(c.get_rows(name, i), x[i])
        assert c.lease_reads == reads + 6
        table = c._mem.leased[name]
        assert table.table.dtype == dtype and tuple(table.table.shape) == tuple(x.shape)
        assert c.get_rows(name, [1]) is not None and c._mem.leased[name] is table  # made once per lease
        c.put(name, x.flip(0))  # a new version: a new lease, a new table
        assert torch.equal(c.get_rows(name, [0, 1]), x.flip(0)[[0, 1]])
        assert torch.equal(c.get_rows(name, [0, 1]), x.flip(0)[[0, 1]])
        assert c._mem.leased[name] is not table
        c.delete(name)
        assert name not in c._mem.leased


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [1, 3, 40, 5000])
def test_a_row_out_of_range_on_the_lease_path_is_named_as_the_general_path_names_it(srv, gather, rows):
    """torch's kernel checks the rows as it copies (``out`` may hold some by then, as after a local
    index_select); numpy's take is checked first (it would clamp), so nothing is written there."""
    x = torch.randn(1000, 16)
    with Client(srv.address, transport="shm") as c:
        c.put("lrows/bad", x)
        c.get_rows("lrows/bad", [0])
        for bad, named in ((1000, 1000), (-1, -1), (1 << 62, 1 << 62), (-(1 << 63), -(1 << 63))):
            idx = torch.randint(0, 1000, (rows,))
            idx[rows // 2] = bad
            out = torch.full((rows, 16), 7.0)
            reads = c.lease_reads
            with pytest.raises(tw.SpecError, match=rf"row {named} out of range for a tensor of 1000 rows"):
                c.get_rows("lrows/bad", idx, out=out)
            if gather == "numpy":
                assert bool((out == 7.0).all()), "a refused get_rows wrote into out"
            assert c.lease_reads == reads
        idx = torch.randint(0, 1000, (rows,))
        assert torch.equal(c.get_rows("lrows/bad", idx), x[idx])  # the lease still serves
        assert c.lease_reads == reads + 1
        c.delete("lrows/bad")


@pytest.mark.timeout(60)
def test_an_out_the_lease_path_cannot_fill_goes_the_general_way(srv):
    x = torch.randn(300, 8)
    idx = torch.tensor([5, 299, 0])
    with Client(srv.address, transport="shm") as c:
        c.put("lrows/out", x)
        c.get_rows("lrows/out", idx)
        nc = torch.empty(8, 3).t()  # not contiguous
        assert torch.equal(c.get_rows("lrows/out", idx, out=nc), x[idx])
        with pytest.raises(tw.ShapeMismatchError):
            c.get_rows("lrows/out", idx, out=torch.empty(3, 9))
        with pytest.raises(tw.ShapeMismatchError):
            c.get_rows("lrows/out", idx, out=torch.empty(3, 8, dtype=torch.float64))
        assert torch.equal(c.get_rows("lrows/out", []), x[:0])
        c.delete("lrows/out")


@pytest.mark.timeout(60)
def test_liveness_is_looked_at_once_per_interval(srv, monkeypatch):
    looks: list[int] = []
    real = shm_maps.LeaseTable.alive
    monkeypatch.setattr(shm_maps.LeaseTable, "alive", lambda self: looks.append(1) or real(self))
    x = torch.randn(100, 4)
    with Client(srv.address, transport="shm") as c:
        c.put("lrows/amortised", x)
        c.get_rows("lrows/amortised", [1])
        looks.clear()
        t0 = time.monotonic()
        for _ in range(200):
            assert torch.equal(c.get_rows("lrows/amortised", [3, 1]), x[[3, 1]])
        took = time.monotonic() - t0
        assert 1 <= len(looks) <= took / shm_maps.LeaseTable.ALIVE_FOR + 2
        c.delete("lrows/amortised")


@pytest.mark.timeout(60)
def test_lease_gathers_time_both_ways_and_keep_the_faster(srv):
    """The first timed lease gathers are a try of numpy's, then torch's (gather_choice.GatherChoice); from then
    on the client uses the one that moved a byte faster, and both give the same rows."""
    rows, width = 20_000, 32
    x = torch.randn(rows, width)
    idx = torch.randint(0, rows, (1_000,), generator=torch.Generator().manual_seed(5))
    assert idx.numel() * width * 4 >= GatherChoice.MIN_BYTES  # timed
    with Client(srv.address, transport="shm") as c:
        c.put("lrows/choice", x)
        assert torch.equal(c.get_rows("lrows/choice", idx), x[idx])  # a request: hands out the lease
        choice = c._mem.copier.choice
        assert choice.cost == [0.0, 0.0]
        reads = c.lease_reads
        out = torch.empty(1_000, width)
        calls = 2 * GatherChoice.TRY_CALLS + 2
        for _ in range(calls):
            assert c.get_rows("lrows/choice", idx, out=out) is out and torch.equal(out, x[idx])
        assert c.lease_reads == reads + calls
        numpy_cost, torch_cost = choice.cost
        assert numpy_cost > 0 and torch_cost > 0
        assert choice.torch == (torch_cost <= numpy_cost)
        small = idx[:10]  # 1,280 bytes: torch's, untimed
        before = list(choice.cost)
        assert torch.equal(c.get_rows("lrows/choice", small), x[small]) and choice.cost == before
        c.delete("lrows/choice")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_lease_get_rows_does_not_outlive_its_daemon(sig):
    with Daemon() as d:
        c = Client(d.address, transport="shm", timeout=10, connect_timeout=3)
        try:
            x = torch.randn(5000, 32)
            c.put("x", x)
            idx = torch.randint(0, 5000, (1000,))
            c.get_rows("x", idx)
            out = torch.empty(1000, 32)
            assert torch.equal(c.get_rows("x", idx, out=out), x[idx]) and c.lease_reads == 1
            d.signal(sig)
            d.wait(30)
            time.sleep(2 * shm_maps.LeaseTable.ALIVE_FOR)  # the longest a lease may outlive a killed daemon
            with pytest.raises(tw.TensorWireError):
                c.get_rows("x", idx, out=out)
            assert c.lease_reads == 1
        finally:
            c.close()


def test_the_index_check_names_the_row_the_general_path_names():
    for idx, rows, named in (
        ([0, 5, 9], 10, None),
        ([0, 10, -3], 10, -3),
        ([0, 10, 12], 10, 12),
        (list(range(100)) + [-5, 200], 100, -5),
        (list(range(100)) + [200], 100, 200),
    ):
        t = torch.tensor(idx, dtype=torch.int64)
        if named is None:
            shm_rows.check_rows(t, rows)
            continue
        with pytest.raises(tw.SpecError, match=rf"row {named} out of range for a tensor of {rows} rows"):
            shm_rows.check_rows(t, rows)
