"""Read leases of the shared-memory path (tensorwire/serve/daemon/shm.py ``Leases``): a client on the daemon's
host reads the version it was handed again without asking, and never gets bytes a writer has touched since."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from tensorwire.serve.client import shm_maps
from tensorwire.serve.client.client import LEASES_ENV, Client
from tensorwire.serve.client.shm_path import leases_wanted as _leases_wanted
from tensorwire.errors import NotFoundError, TensorWireError
from tensorwire.serve.daemon import shm as daemon_shm

from serve_common import Daemon, in_process, shm_room
from test_serve_shm import _metric, _metrics, _session

pytestmark = [
    pytest.mark.skipif(not shm_room(), reason="no /dev/shm here, or under 256 MiB free in it"),
    pytest.mark.skipif(not _leases_wanted(), reason="read leases are for x86 clients only"),
]


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="auto", max_bytes="1GiB", metrics_port=0) as s:
        yield s


def _requests(srv, c: Client, op: str) -> float:
    """Data-plane requests of ``op`` the daemon answered (tensorwire_operations_total counts lease reads too)."""
    body = _metrics(srv)
    return _metric(body, f'tensorwire_operations_total{{op="{op}",status="ok"}}')


# -- the table itself ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_lease_generations_only_grow_also_across_a_freed_cell(tmp_path):
    reg = daemon_shm.Registry(str(tmp_path))
    try:
        leases = daemon_shm.Leases(reg, cells=3)
        a = leases.alloc()
        b = leases.alloc()
        assert {a, b} == {1, 2} and leases.alloc() == 0  # cell 0 is never handed out; none left
        g0 = leases.gen(a)
        leases.bump(a, 1)
        assert leases.gen(a) % 2 == 1  # a row update in place: odd while it writes
        leases.bump(a, 1)
        leases.bump(a)
        seen = leases.gen(a)
        assert seen == g0 + 4
        leases.free(a)
        again = leases.alloc()
        assert again == a and leases.gen(a) > seen and leases.gen(a) % 2 == 0
        leases.close()
        assert leases.gen(b) % 2 == 1 and leases.alloc() == 0  # sealed: no lease can match any more
    finally:
        reg.close()


# -- used, counted, off -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_reads_after_the_first_are_served_from_the_lease_and_counted_by_the_daemon(srv):
    table = torch.randn(5000, 64)
    with Client(srv.address, transport="shm") as c:
        c.put("lease-count", table)
        idx = torch.tensor([4999, 0, 17, 17, 2500])
        assert torch.equal(c.get_rows("lease-count", idx), table[idx])  # asks: pins, hands out the lease
        assert torch.equal(c.get("lease-count"), table)
        assert c.lease_reads == 1  # that get already: a lease is per tensor, not per kind of read
        time.sleep(0.1)  # the client's helper gives the first read's pin back (a RELEASE request) meanwhile
        before_rows, before_get = _requests(srv, c, "GetRows"), _requests(srv, c, "Get")
        sent = c._path.req_id
        for _ in range(20):
            j = torch.randint(0, 5000, (64,))
            assert torch.equal(c.get_rows("lease-count", j), table[j])
            out = torch.empty_like(table)
            assert c.get("lease-count", out=out) is out and torch.equal(out, table)
        assert c._path.req_id == sent, "a lease read sent a request"
        assert c.lease_reads == 41 and c.lease_misses == 0
        # the daemon never saw them, but counts them (from the session's page) at the next scrape
        assert _requests(srv, c, "GetRows") == before_rows + 20
        assert _requests(srv, c, "Get") == before_get + 20
        c.delete("lease-count")


@pytest.mark.timeout(60)
def test_leases_off_by_environment(srv, monkeypatch):
    monkeypatch.setenv(LEASES_ENV, "0")
    with Client(srv.address, transport="shm") as c:
        c.put("lease-off", torch.arange(100.0))
        for _ in range(3):
            assert torch.equal(c.get("lease-off"), torch.arange(100.0))
        assert c.lease_reads == 0 and c._path.req_id >= 4  # every read asked
        c.delete("lease-off")


# -- never stale -----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("write", ["put", "put_rows", "add_rows", "delete+put"])
def test_a_write_by_another_client_ends_the_lease(srv, write):
    x = torch.zeros(256, 32)
    with Client(srv.address, transport="shm") as reader, Client(srv.address, transport="shm") as writer:
        writer.put("lease-w", x)
        assert torch.equal(reader.get("lease-w"), x)
        assert torch.equal(reader.get("lease-w"), x) and reader.lease_reads == 1  # held
        if write == "put":
            writer.put("lease-w", x + 1)
            want = x + 1
        elif write == "put_rows":
            writer.put_rows("lease-w", [3], torch.full((1, 32), 7.0))
            want = x.clone()
            want[3] = 7.0
        elif write == "add_rows":
            writer.add_rows("lease-w", [0, 255], torch.ones(2, 32))
            want = x.clone()
            want[[0, 255]] += 1
        else:
            writer.delete("lease-w")
            with pytest.raises(NotFoundError):
                reader.get("lease-w")
            writer.put("lease-w", x - 1)
            want = x - 1
        assert torch.equal(reader.get("lease-w"), want)
        assert torch.equal(reader.get_rows("lease-w", [3, 0, 255]), want[[3, 0, 255]])
        assert reader.lease_misses >= 1
        writer.delete("lease-w")
        with pytest.raises(NotFoundError):
            reader.get_rows("lease-w", [0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", ["put", "add_rows"])
def test_lease_reads_never_see_a_mix_of_two_versions(srv, write):
    """A writer keeps changing every element (whole puts, or adds to every row in place); each read must be one
    version: all elements equal."""
    rows, width = 2048, 512  # 4 MiB: a copy takes long enough for writers to land mid-copy
    with Client(srv.address, transport="shm") as reader, Client(srv.address, transport="shm") as writer:
        writer.put("lease-mix", torch.zeros(rows, width))
        stop = threading.Event()
        errors: list[BaseException] = []

        def write_loop() -> None:
            k = 0.0
            try:
                while not stop.is_set():
                    k += 1
                    if write == "put":
                        writer.put("lease-mix", torch.full((rows, width), k))
                    else:
                        writer.add_rows("lease-mix", torch.arange(rows), torch.ones(rows, width))
                    if k % 4 == 0:
                        # a pause now and then, so that some leases stay valid for a read: on a 16-core host the
                        # puts back to back made every lease stale before its next read (0 lease reads in 1,665)
                        time.sleep(0.003)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        th = threading.Thread(target=write_loop, daemon=True)
        th.start()
        try:
            idx = torch.randperm(rows)[:1024]
            deadline = time.monotonic() + 6
            reads = 0
            values = set()
            while time.monotonic() < deadline:
                whole = reader.get("lease-mix")
                v = whole[0, 0].item()
                assert bool((whole == v).all()), f"a read mixed versions (first element {v})"
                part = reader.get_rows("lease-mix", idx)
                assert bool((part == part[0, 0]).all()), "a get_rows mixed versions"
                values.add(v)
                reads += 2
        finally:
            stop.set()
            th.join(30)
        assert not errors, errors
        assert len(values) > 3, "the writer did not get through: the test proved nothing"
        # both paths were exercised: reads from leases, and leases found stale under the writer
        assert reader.lease_reads > 0 and reader.lease_misses > 0, (reader.lease_reads, reader.lease_misses)
        if write == "put":  # ... and the writer's puts went through write-ahead grants (test_serve_ahead.py)
            assert writer.ahead_puts > 0, "no put went through a grant"
        writer.delete("lease-mix")


# -- the daemon goes ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_lease_does_not_outlive_its_daemon(sig):
    with Daemon() as d:
        c = Client(d.address, transport="shm", timeout=10, connect_timeout=3)
        try:
            c.put("x", torch.ones(4096))
            c.get("x")
            assert torch.equal(c.get("x"), torch.ones(4096)) and c.lease_reads == 1
            d.signal(sig)
            d.wait(30)
            time.sleep(2 * shm_maps.LeaseTable.ALIVE_FOR)  # the longest a lease may outlive a killed daemon
            # the table of a dead daemon never changes again: the lease must not be used
            with pytest.raises(TensorWireError):
                c.get("x")
            assert c.lease_reads == 1
        finally:
            c.close()


@pytest.mark.timeout(60)
def test_the_session_page_only_adds_growth(srv):
    with Client(srv.address, transport="shm") as c:
        c.put("lease-page", torch.ones(10))
        c.get("lease-page")
        c.get("lease-page")
        s = _session(srv, c)
        assert s.shm_page is not None and c._path.page is not None
        before = _requests(srv, c, "Get")
        c._path.page.counts[0] = 0  # a client writing nonsense into its own page: counters never go back
        assert _requests(srv, c, "Get") == before
        c.get("lease-page")
        assert _requests(srv, c, "Get") == before  # 1 again is below what was seen: nothing added
        c.delete("lease-page")
