"""A sharded table read and written through shared memory: one gather over the daemons' slots mapped side by
side (:mod:`tensorwire.serve.client.window`), value rows copied once on their way to each daemon, and the
per-daemon path (sockets) beside it giving the same answers."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client import window
from tensorwire.serve.client.client import LEASES_ENV, Client
from tensorwire.serve.client import shm_maps
from tensorwire.serve.client.sharded_client import ShardedClient
from tensorwire.serve.client.window import RowWindow, ShardView
from tensorwire.serve.daemon import shm as daemon_shm
from tensorwire.serve.protocol import shm
from tensorwire.serve.protocol.layout import row_ranges
from tensorwire.spec import TensorSpec

from serve_common import SHM, Daemon, shm_room

pytestmark = pytest.mark.skipif(
    not (window.supported() and shm_room()), reason="needs 64-bit Linux and /dev/shm with 256 MiB free"
)


def _perms(win: RowWindow) -> set[str]:
    """The permissions of this process's mappings of daemon regions inside ``win``'s address range."""
    lo, hi = win.array.ctypes.data, win.array.ctypes.data + win.array.nbytes
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            addr, perms, *rest = line.split()
            a, b = (int(x, 16) for x in addr.split("-"))
            if lo <= a and b <= hi and rest and "tensorwire-" in rest[-1]:
                out.add(perms)
    return out


def _mapped(regions: list[str]) -> set[str]:
    """Which of ``regions`` this process maps now."""
    with open("/proc/self/maps") as f:
        text = f.read()
    return {r for r in regions if r in text}


# -- the window on its own ----------------------------------------------------------------------------
@pytest.mark.parametrize("row_bytes", [3, 12, 512, 4100])
def test_a_window_puts_rows_of_every_shard_on_one_grid_and_one_take_gathers_them(row_bytes):
    import numpy as np

    reg = daemon_shm.Registry()
    try:
        rows = 2_001
        ranges = row_ranges(rows, 3)
        table = np.random.default_rng(0).integers(0, 255, (rows, row_bytes), dtype=np.uint8)
        regions = []
        for a, b in ranges:
            r = reg.create((b - a) * row_bytes)
            r.tensor.numpy()[: (b - a) * row_bytes] = table[a:b].reshape(-1)
            regions.append(r)
        spec = TensorSpec("t", (rows, row_bytes), "uint8")
        win = RowWindow([b - a for a, b in ranges], row_bytes, [a for a, _ in ranges])
        for k, ((a, b), r) in enumerate(zip(ranges, regions)):
            win.bind(k, ShardView(r.name, 0, (b - a) * row_bytes, spec))
        assert sorted(win.regions()) == sorted(r.name for r in regions)
        idx = np.random.default_rng(1).integers(0, rows, 5_000)
        shard = np.searchsorted([a for a, _ in ranges[1:]], idx, side="right")
        out = np.empty((idx.size, row_bytes), np.uint8)
        np.take(win.array, idx + win.delta[shard], axis=0, out=out)
        assert np.array_equal(out, table[idx])
        assert _perms(win) == {"r--s"}  # the daemon's memory is read through it, never written

        # another slot for shard 1 (a new version): rebinding maps it in place of the old one
        a, b = ranges[1]
        new = reg.create((b - a) * row_bytes)
        new.tensor.numpy()[: (b - a) * row_bytes] = 7
        win.bind(1, ShardView(new.name, 0, (b - a) * row_bytes, spec))
        assert int(win.array[win.first[1]][0]) == 7 and sorted(win.regions()) == sorted(
            [regions[0].name, new.name, regions[2].name]
        )
        with pytest.raises(shm.ShmError):  # bytes that are not shard 0's rows
            win.bind(0, ShardView(regions[0].name, 0, row_bytes, spec))
        with pytest.raises(shm.ShmError):  # never a path or a name a daemon would not make
            win.bind(2, ShardView("../etc/passwd", 0, (ranges[2][1] - ranges[2][0]) * row_bytes, spec))
        kept = win.array[win.first[0] : win.first[0] + 3]  # an array of the window that outlives it
        assert bool((kept == table[:3]).all())  # shard 0 is still bound (shard 2 was let go by the refusal)
        win.close()
        win.close()
        assert win.array is None and win.regions() == []
        assert int(kept.sum()) == 0  # the slots are let go: zeros in their place, never a fault
    finally:
        reg.close()


# -- three daemons on loopback ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemons():
    ds = [Daemon("--max-bytes", "512MiB", transport="tcp") for _ in range(3)]
    try:
        yield ds
    finally:
        for d in ds:
            d.close()


def _client(daemons, **kw) -> ShardedClient:
    c = tw.Client([d.address for d in daemons], timeout=10.0, connect_timeout=10.0, **kw)
    assert isinstance(c, ShardedClient)
    return c


@pytest.fixture
def no_per_daemon_get_rows(monkeypatch):
    """Fail any get_rows of a one-daemon client: reads must go through the window."""

    def refuse(self, *a, **kw):
        raise AssertionError("a per-daemon get_rows ran")

    monkeypatch.setattr(Client, "get_rows", refuse)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float16, torch.bool])
def test_get_rows_over_shared_memory_is_one_gather_in_the_callers_order(daemons, dtype, no_per_daemon_get_rows):
    rows = 30_001
    g = torch.Generator().manual_seed(1)
    table = (torch.randn(rows, 3, generator=g) * 50).to(dtype)  # 3 columns: rows of 3 or 6 bytes
    with _client(daemons) as c:
        c.put("g", table, shard="rows")
        assert c.data_path == "shm"
        idx = torch.randint(0, rows, (5_000,), generator=g)
        idx[:3] = torch.tensor([rows - 1, 0, rows - 1])  # both ends, duplicates
        before = sum(d.shm_bytes for d in c._daemons.clients)
        assert torch.equal(c.get_rows("g", idx), table[idx])
        assert torch.equal(c.get_rows("g", idx), table[idx])  # the second one from the leases
        assert sum(d.shm_bytes for d in c._daemons.clients) - before == 2 * idx.numel() * 3 * table.element_size()
        out = torch.empty(idx.numel(), 3, dtype=dtype)
        assert c.get_rows("g", idx, out=out) is out and torch.equal(out, table[idx])
        strided = torch.empty(3, idx.numel(), dtype=dtype).t()  # not contiguous: through a buffer
        assert c.get_rows("g", idx, out=strided) is strided and torch.equal(strided, table[idx])
        one = torch.tensor([5, 4, 3])  # rows of one shard only
        assert torch.equal(c.get_rows("g", one), table[one])
        assert c.get_rows("g", []).shape == (0, 3)
        for bad in ([rows], [-1], [0, rows + 5]):
            with pytest.raises(tw.SpecError, match="out of range"):
                c.get_rows("g", bad)
        with pytest.raises(tw.ShapeMismatchError):
            c.get_rows("g", idx, out=torch.empty(idx.numel(), 4, dtype=dtype))
        c.delete("g")


@pytest.mark.timeout(120)
def test_pinned_reads_writes_between_and_a_racing_writer_keep_every_read_whole(
    daemons, monkeypatch, no_per_daemon_get_rows
):
    rows, dim = 9_000, 8
    g = torch.Generator().manual_seed(2)
    table = torch.randn(rows, dim, generator=g)
    idx = torch.randint(0, rows, (2_000,), generator=g)
    monkeypatch.setenv(LEASES_ENV, "0")
    with _client(daemons) as c:  # no leases: every read pins each daemon's version by a request
        c.put("p", table, shard="rows")
        assert torch.equal(c.get_rows("p", idx), table[idx])
        assert all(c._daemons.client(k).lease_reads == 0 for k in range(3))
        c.delete("p")
    monkeypatch.delenv(LEASES_ENV)
    with _client(daemons) as c:
        c.put("p", table, shard="rows")
        assert torch.equal(c.get_rows("p", idx), table[idx])
        c.add_rows("p", idx, torch.ones(idx.numel(), dim))  # in place: the leases go stale
        table.index_add_(0, idx, torch.ones(idx.numel(), dim))
        assert torch.allclose(c.get_rows("p", idx), table[idx])
        table = torch.randn(rows, dim, generator=g)
        c.put("p", table, shard="rows")  # a new version in the other slot: the window maps it instead
        assert torch.equal(c.get_rows("p", idx), table[idx])
        assert torch.equal(c.get_rows("p", idx), table[idx])
        assert sum(c._daemons.client(k).lease_reads for k in range(3)) >= 3

        # a writer that comes while rows are copied out of a lease: the copy does not count, it is made again
        checks = []
        real = ShardView.valid

        def racing(self):
            checks.append(self.cells is not None)
            return False if self.cells is not None else real(self)

        monkeypatch.setattr(ShardView, "valid", racing)
        assert torch.equal(c.get_rows("p", idx), table[idx])
        assert checks == [True, False, False, False]  # the lease copy (stale at once), then a pinned one
        monkeypatch.setattr(ShardView, "valid", real)

        regions = [r for _, w in c._rows._windows.values() for r in w.regions()]
        assert len(regions) == 3 and _mapped(regions) == set(regions)
        c.delete("p")  # the window goes with the table: the daemons' memory is not held here
        assert not _mapped(regions)


@pytest.mark.timeout(120)
def test_readers_racing_row_updates_see_one_whole_version_of_each_shard(daemons):
    rows, dim = 20_000, 64  # reads of 5 MB: a write often starts while one is copying
    ranges = row_ranges(rows, 3)
    with _client(daemons) as c, _client(daemons) as w:  # the writer on sessions of its own
        c.put("race", torch.zeros(rows, dim), shard="rows")
        everything = torch.arange(rows)
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for _ in range(40):
                    w.add_rows("race", everything, torch.ones(rows, dim))  # every row of every shard, +1
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                stop.set()

        def reader(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            try:
                while not stop.is_set():
                    idx = torch.randint(0, rows, (rows,), generator=g)
                    got = c.get_rows("race", idx)
                    for a, b in ranges:  # a shard is one version: all its rows hold the same count
                        part = got[(idx >= a) & (idx < b)]
                        assert part.numel() == 0 or bool((part == part[0, 0]).all()), "a torn read"
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (1, 2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(100)
        assert not any(th.is_alive() for th in threads) and not errors, errors
        assert torch.equal(c.get("race"), torch.full((rows, dim), 40.0))
        c.delete("race")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", [SHM, "tcp"])
def test_row_updates_in_any_order_copy_each_value_row_once_to_its_daemon(daemons, path, monkeypatch):
    rows, dim = 12_000, 16
    g = torch.Generator().manual_seed(3)
    table = torch.randn(rows, dim, generator=g)
    with _client(daemons, transport="auto" if path == "shm" else "tcp") as c:
        assert c.data_path == ("shm" if path == "shm" else "tcp")
        c.put("u", table, shard="rows")
        picked: list[int] = []
        real = Client.update_rows

        def spy(self, name, index, values, *, add, pick=None):
            assert values.data_ptr() == vals.data_ptr()  # the caller's tensor itself, never a sorted copy
            picked.append(0 if pick is None else pick.numel())
            return real(self, name, index, values, add=add, pick=pick)

        monkeypatch.setattr(Client, "update_rows", spy)
        idx = torch.randint(0, rows, (4_000,), generator=g)
        vals = torch.randn(idx.numel(), dim, generator=g)
        c.add_rows("u", idx, vals)  # duplicates accumulate
        table.index_add_(0, idx, vals)
        assert sum(picked) == idx.numel() and len(picked) == 3
        uniq = torch.randperm(rows, generator=g)[:3_000]
        vals = torch.randn(uniq.numel(), dim, generator=g)
        c.put_rows("u", uniq, vals)
        table[uniq] = vals
        monkeypatch.setattr(Client, "update_rows", real)
        assert torch.allclose(c.get_rows("u", idx), table[idx], atol=1e-5)
        assert torch.allclose(c.get("u"), table, atol=1e-5)
        c.delete("u")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [SHM, "tcp"])
def test_one_daemon_update_rows_takes_the_picked_value_rows(daemons, path):
    with Client(daemons[0].address, transport="auto" if path == "shm" else "tcp", timeout=10.0) as c:
        t = torch.zeros(50, 3)
        c.put("one", t)
        vals = torch.arange(30.0).view(10, 3)
        pick = torch.tensor([9, 0, 4, 4])
        c.update_rows("one", [1, 2, 3, 2], vals, add=True, pick=pick)
        t.index_add_(0, torch.tensor([1, 2, 3, 2]), vals[pick])
        c.update_rows("one", [40], vals.t().contiguous().t(), add=False, pick=torch.tensor([7]))  # not contiguous
        t[40] = vals[7]
        assert torch.equal(c.get("one"), t)
        with pytest.raises(tw.ShapeMismatchError):
            c.update_rows("one", [1, 2], vals, add=True, pick=torch.tensor([0]))
        with pytest.raises(tw.ShapeMismatchError):
            c.update_rows("one", [1], vals, add=True, pick=torch.tensor([10]))
        assert torch.equal(c.get("one"), t)  # nothing was written by the refused ones
        c.delete("one")


def test_no_window_where_mapping_at_an_address_is_not_possible(daemons, monkeypatch):
    monkeypatch.setattr(window, "_libc", False)  # as on a platform without it
    assert not window.supported()
    table = torch.randn(3_000, 4)
    idx = torch.tensor([2_999, 0, 1_500, 7])
    with _client(daemons) as c:
        c.put("nw", table, shard="rows")
        assert torch.equal(c.get_rows("nw", idx), table[idx])  # each daemon's rows, put in order here
        assert not c._rows._windows
        c.delete("nw")


@pytest.mark.timeout(120)
def test_a_daemon_that_stops_answering_is_reported_within_the_timeout_and_comes_back(daemons):
    # SIGSTOP: the daemon's sockets stay open and nothing answers, as over a cut link
    timeout = 2.0
    rows = 9_000
    table = torch.randn(rows, 8)
    with tw.Client(
        [d.address for d in daemons], transport="tcp", timeout=timeout, connect_timeout=10.0
    ) as c:  # connect_timeout longer than timeout: it must not stretch an operation
        c.put("stop", table, shard="rows")
        a, _ = row_ranges(rows, 3)[1]
        victim = daemons[1]
        victim.signal(signal.SIGSTOP)
        try:
            _wait_stopped(victim.proc.pid)
            for what, op in (
                ("get_rows", lambda: c.get_rows("stop", [0, a + 1])),  # on the open session: no answer
                ("get", lambda: c.get("stop")),  # that session is gone: a new one cannot be opened
                ("add_rows", lambda: c.add_rows("stop", [a], torch.ones(1, 8))),
            ):
                t0 = time.monotonic()
                try:
                    op()
                except tw.ShardLostError as exc:
                    err = exc
                else:
                    pytest.fail(f"{what} on a stopped daemon: no error after {time.monotonic() - t0:.2f} s")
                assert time.monotonic() - t0 < timeout + 1.0, what
                assert err.address == victim.address and victim.address in str(err), (what, err)
            mine = torch.tensor([0, 1, rows - 1])  # the other shards still answer
            assert torch.equal(c.get_rows("stop", mine), table[mine])
        finally:
            victim.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:
            try:
                got = c.get_rows("stop", [a + 1, 0])
                break
            except tw.ShardLostError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert torch.equal(got, table[[a + 1, 0]])
        c.delete("stop")


def _wait_stopped(pid: int) -> None:
    """Until the kernel shows process ``pid`` stopped (state T)."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, "the daemon did not stop"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_lease_gather_through_torchs_thread_pool_reads_the_same_rows_without_a_warning(
    daemons, monkeypatch, no_per_daemon_get_rows
):
    # a lease read that torch gathers (shm_maps.Copier.torch_gather) is torch's index_select over the window
    monkeypatch.setattr(shm_maps.Copier, "torch_gather", lambda self, nbytes: True)
    rows = 20_000
    table = torch.randn(rows, 16)
    idx = torch.randint(0, rows, (3_000,))
    with _client(daemons) as c:
        c.put("tg", table, shard="rows")
        assert torch.equal(c.get_rows("tg", idx), table[idx])  # pinned: maps the window, takes the leases
        taken = []
        real = torch.index_select
        monkeypatch.setattr(torch, "index_select", lambda *a, **kw: taken.append(1) or real(*a, **kw))
        before = sum(d.lease_reads for d in c._daemons.clients)
        assert torch.equal(c.get_rows("tg", idx), table[idx])  # pytest turns any warning into an error
        assert taken and sum(d.lease_reads for d in c._daemons.clients) == before + 3
        c.delete("tg")
