"""Write-ahead grants of the shared-memory path (tensorwire/serve/store.py ``AheadGrant``, shm.py ``PageLock``):
a client that commits a put is handed the tensor's staging slot for its next put (one copy and one COMMIT), and
gives it up the moment anyone else needs it -- never while it writes there, never leaving a half-written version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from tensorwire.serve.client.client import AHEAD_ENV, Client
from tensorwire.errors import NotFoundError
from tensorwire.serve.protocol import shm, wire

from serve_common import ROOT, clean_env, in_process, shm_room
from test_serve_shm import _metric, _metrics, _session

pytestmark = pytest.mark.skipif(not shm_room(), reason="no /dev/shm here, or under 256 MiB free in it")

N = 1 << 18  # float32 elements: 1 MiB


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="auto", max_bytes="1GiB", metrics_port=0) as s:
        yield s


def _entry(srv, name: str):
    return srv.service.store.get(name)


def _hold_grant(srv, c: Client, name: str) -> None:
    """Two puts of ``name`` by ``c``: the second's commit grants it the slot for a third."""
    c.put(name, torch.zeros(N))
    c.put(name, torch.ones(N))
    assert _granted(srv, c, name)


def _granted(srv, c: Client, name: str) -> bool:
    """Whether the daemon holds a write-ahead grant of ``name`` for ``c``'s session (and the client knows it)."""
    s = _session(srv, c)
    g = s.ahead
    return g is not None and g.entry.spec.name == name and _entry(srv, name).ahead is g and c._path.ahead is not None


# -- used, counted, off -------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_repeated_puts_go_through_the_grant_and_every_version_is_whole(srv):
    with Client(srv.address, transport="shm") as w, Client(srv.address, transport="shm") as r:
        before = _metric(_metrics(srv), 'tensorwire_operations_total{op="Put",status="ok"}')
        for i in range(20):
            x = torch.full((N,), float(i))
            st = w.put("ahead-use", x)
            assert st.version == i + 1
            assert torch.equal(r.get("ahead-use"), x)
            time.sleep(0.02)  # the reader's pin of this version goes back meanwhile (its idle RELEASE): a pinned
            # slot is never granted, and this version's slot is the one the put after next would be granted
        assert w.ahead_puts >= 17, w.ahead_puts  # all but the first (and a put after a pinned read, if any)
        assert w.shm_bytes == 20 * 4 * N
        # the daemon counts them as the puts they are
        assert _metric(_metrics(srv), 'tensorwire_operations_total{op="Put",status="ok"}') - before == 20
        assert _granted(srv, w, "ahead-use")
        w.delete("ahead-use")


@pytest.mark.timeout(60)
def test_grants_off_by_environment(srv, monkeypatch):
    monkeypatch.setenv(AHEAD_ENV, "0")
    with Client(srv.address, transport="shm") as c:
        assert _session(srv, c).shm_version == shm.LEASE_VERSION  # the client offered no more
        for i in range(5):
            c.put("ahead-off", torch.full((N,), float(i)))
        assert c.ahead_puts == 0 and _session(srv, c).ahead is None
        assert _entry(srv, "ahead-off").putting is False
        assert torch.equal(c.get("ahead-off"), torch.full((N,), 4.0))
        c.delete("ahead-off")


# -- given up when anyone else needs it ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_another_writer_takes_the_tensor_over_at_once(srv):
    with Client(srv.address, transport="shm") as a, Client(srv.address, transport="shm") as b:
        _hold_grant(srv, a, "ahead-two")
        t0 = time.monotonic()
        b.put("ahead-two", torch.full((N,), 2.0))  # revokes a's grant: a is not writing
        assert time.monotonic() - t0 < 5
        assert int(a._path.page.ahead[0]) == 0  # the ticket a would check is gone
        assert torch.equal(a.get("ahead-two"), torch.full((N,), 2.0))
        n = a.ahead_puts
        a.put("ahead-two", torch.full((N,), 3.0))  # the ordinary way (the get ended a's hold anyway)
        assert a.ahead_puts == n
        assert torch.equal(b.get("ahead-two"), torch.full((N,), 3.0))
        a.put("ahead-two", torch.full((N,), 4.0))  # ... and granted again
        assert a.ahead_puts == n + 1
        assert torch.equal(b.get("ahead-two"), torch.full((N,), 4.0))
        a.delete("ahead-two")


@pytest.mark.timeout(60)
def test_a_writer_waits_while_the_grant_holder_writes(srv):
    """The holder's page lock is what a revocation needs: while the holder holds it (writing), another put
    waits; once it lets go, that put goes ahead."""
    with Client(srv.address, transport="shm") as a, Client(srv.address, transport="shm") as b:
        _hold_grant(srv, a, "ahead-lock")
        assert a._path.page.lock.try_lock()  # as a does from its check of the ticket to its COMMIT's reply
        done = threading.Event()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                b.put("ahead-lock", torch.full((N,), 5.0))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            done.set()

        th = threading.Thread(target=other, daemon=True)
        th.start()
        try:
            assert not done.wait(0.5), "another writer got the slot while its grant's holder was writing"
            assert _entry(srv, "ahead-lock").put_waiting == 1
        finally:
            a._path.page.lock.unlock()
        assert done.wait(10) and not errors, errors
        th.join(5)
        assert torch.equal(a.get("ahead-lock"), torch.full((N,), 5.0))
        a.delete("ahead-lock")


@pytest.mark.timeout(60)
def test_any_other_request_ends_the_grant(srv):
    with Client(srv.address, transport="shm") as a:
        _hold_grant(srv, a, "ahead-req")
        e = _entry(srv, "ahead-req")
        assert e.putting  # the grant is a put reservation
        a.get_rows("ahead-req", [0, 1])
        assert _session(srv, a).ahead is None and e.ahead is None and not e.putting
        assert a._path.ahead is None and int(a._path.page.ahead[0]) == 0
        a.delete("ahead-req")


@pytest.mark.timeout(60)
def test_a_delete_ends_the_grant_and_the_regions_go(srv):
    with Client(srv.address, transport="shm") as a, Client(srv.address, transport="shm") as b:
        _hold_grant(srv, a, "ahead-del")
        e = _entry(srv, "ahead-del")
        paths = [sl.region.path for sl in e.slots]
        b.delete("ahead-del")
        assert not e.putting and e.ahead is None
        assert not any(os.path.exists(p) for p in paths)  # nothing pins them: unlinked at once
        with pytest.raises(NotFoundError):
            a.get("ahead-del")
        n = a.ahead_puts
        a.put("ahead-del", torch.full((N,), 7.0))  # a new tensor of that name: the ordinary way
        assert a.ahead_puts == n
        assert torch.equal(b.get("ahead-del"), torch.full((N,), 7.0))
        a.delete("ahead-del")


@pytest.mark.timeout(60)
def test_a_commit_of_a_grant_that_ended_changes_nothing_and_falls_back(srv):
    """A client that sends a write-ahead COMMIT the daemon does not hold (here: a ticket of its own making)
    gets FALLBACK; the put then goes the ordinary way and lands whole."""
    with Client(srv.address, transport="shm") as a:
        _hold_grant(srv, a, "ahead-fb")
        name, spec, region, ticket = a._path.ahead
        a._path.ahead = (name, spec, region, ticket + 5)
        a._path.page.ahead[0] = ticket + 5  # a confused client: the daemon never wrote that ticket
        v = a.stat("ahead-fb").version
        n = a.ahead_puts
        st = a.put("ahead-fb", torch.full((N,), 9.0))
        assert a.ahead_puts == n and st.version == v + 1
        assert torch.equal(a.get("ahead-fb"), torch.full((N,), 9.0))
        a.delete("ahead-fb")


@pytest.mark.timeout(60)
def test_a_put_of_another_shape_is_refused_while_granted(srv):
    import tensorwire as tw

    with Client(srv.address, transport="shm") as a:
        x = torch.arange(12.0).reshape(3, 4)
        a.put("ahead-shape", x)
        a.put("ahead-shape", x * 2)
        assert _granted(srv, a, "ahead-shape")
        for other in (torch.zeros(4, 3), torch.zeros(12), torch.zeros(3, 4, dtype=torch.int32)):  # same byte count
            with pytest.raises(tw.ShapeMismatchError):
                a.put("ahead-shape", other)
        assert torch.equal(a.get("ahead-shape"), x * 2) and a.stat("ahead-shape").version == 2
        a.delete("ahead-shape")


# -- consistency ------------------------------------------------------------------------------------------------------


# (readers never see a mix of two versions while puts go through grants: test_serve_leases.py's
# test_lease_reads_never_see_a_mix_of_two_versions[put], whose writer's puts do)


_DIES_MID_WRITE = textwrap.dedent("""
    import os, signal, sys, torch
    from tensorwire.serve.client.client import Client
    c = Client(sys.argv[1], transport="shm")
    c.put("ahead-kill", torch.zeros(1 << 18))
    c.put("ahead-kill", torch.ones(1 << 18))
    name, spec, region, ticket = c._path.ahead
    nbytes = 4 << 18
    assert c._path.page.lock.try_lock() and int(c._path.page.ahead[0]) == ticket
    c._mem.maps.get(region, 0, nbytes)[: nbytes // 2].fill_(0xFF)  # half of the next version, then gone
    print("writing", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.timeout(120)
def test_a_client_killed_while_writing_a_grant_leaves_the_last_version(srv):
    proc = subprocess.Popen(
        [sys.executable, "-c", _DIES_MID_WRITE, srv.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(None),
        cwd=ROOT,
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL and "writing" in out, (proc.returncode, out, err)
    with Client(srv.address, transport="shm") as b:
        assert torch.equal(b.get("ahead-kill"), torch.ones(N))  # the last committed version, whole
        t0 = time.monotonic()
        b.put("ahead-kill", torch.full((N,), 3.0))  # the dead client's grant does not hold the tensor
        assert time.monotonic() - t0 < 30
        assert torch.equal(b.get("ahead-kill"), torch.full((N,), 3.0))
        b.delete("ahead-kill")


# -- the wire ---------------------------------------------------------------------------------------------------------


def _request(op: int, *, flags: int = 0, shape: tuple[int, ...] = ()) -> memoryview:
    buf = bytearray(wire.MAX_REQUEST_BYTES)
    end = wire.pack_request(memoryview(buf), op=op, req_id=1, name=b"t", flags=flags, shape=shape)
    return memoryview(buf)[:end]


def test_write_ahead_commit_format():
    req = wire.parse_request(_request(wire.OP_COMMIT, flags=wire.FLAG_AHEAD, shape=(42,)))
    assert req.ahead == 42 and not req.shm
    assert wire.parse_request(_request(wire.OP_COMMIT)).ahead == 0
    for bad in (
        dict(op=wire.OP_COMMIT, flags=wire.FLAG_AHEAD),  # no ticket
        dict(op=wire.OP_COMMIT, flags=wire.FLAG_AHEAD, shape=(0,)),  # ticket 0
        dict(op=wire.OP_COMMIT, flags=wire.FLAG_AHEAD, shape=(1, 2)),
        dict(op=wire.OP_COMMIT, flags=wire.FLAG_AHEAD | wire.FLAG_SHM, shape=(1,)),
        dict(op=wire.OP_PUT, flags=wire.FLAG_AHEAD),
        dict(op=wire.OP_COMMIT, shape=(1,)),
    ):
        with pytest.raises(wire.MalformedRequest):
            wire.parse_request(_request(**bad))
