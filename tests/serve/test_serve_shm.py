"""The same-host shared-memory data path of ``tensorwire serve`` (tensorwire/serve/protocol/shm.py, with the
daemon's half in daemon/shm.py and the client's in client/shm_maps.py): negotiation and its fallbacks, bytes that
never cross the socket, pins and commits, region lifetimes, and the checks on both sides."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.client.context import Progress
from tensorwire.serve.client import shm_maps
from tensorwire.serve.daemon import shm as daemon_shm
from tensorwire.serve.protocol import shm, wire
from tensorwire.serve.protocol.common import TAG_REQUEST

from serve_common import ALL_DTYPES, ROOT, Daemon, clean_env, in_process, shm_room

# A container's default /dev/shm (64 MiB) cannot hold these tests' regions: the daemon would (correctly)
# serve from ordinary memory over the socket, and the assertions that bytes went through shm would fail.
pytestmark = pytest.mark.skipif(not shm_room(), reason="no /dev/shm here, or under 256 MiB free in it")


def _files(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix))


def _wait_for(pred, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _socket_bytes(c: Client) -> int:
    t = c._path.transport
    return int(getattr(t, "bytes_sent", 0)) + int(getattr(t, "bytes_received", 0))


def _metrics(srv) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()


def _metric(body: str, line_prefix: str) -> float:
    for line in body.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _session(srv, c: Client):
    (s,) = [x for x in srv.service.sessions() if x.id == c._sid]
    return s


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="auto", max_bytes="1GiB", metrics_port=0) as s:
        assert s.ready_info()["shm"]
        yield s


# -- negotiated and used ------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_shm_is_negotiated_on_loopback_and_bytes_never_cross_the_socket(srv):
    n = 8 << 20  # 32 MiB of float32
    x = torch.randn(n // 256, 256)
    body0 = _metrics(srv)
    with Client(srv.address, transport="auto") as c:
        assert c.shm and c.data_path == "shm" and c.transport_kind in ("ucx", "tcp")
        assert _session(srv, c).shm and _session(srv, c).shm_hello is None  # proven; the hello region is gone
        sock0 = _socket_bytes(c)
        c.put("neg", x)
        c.put("neg", x * 2)
        assert torch.equal(c.get("neg"), x * 2)
        out = torch.empty(n // 256, 256)
        assert c.get("neg", out=out) is out and torch.equal(out, x * 2)
        tab = x * 2
        idx = torch.randint(0, tab.shape[0], (5000,))
        assert torch.equal(c.get_rows("neg", idx), tab[idx])
        c.put_rows("neg", [0, 1], torch.zeros(2, 256))
        c.add_rows("neg", [2, 2], torch.ones(2, 256))
        tab[[0, 1]] = 0
        tab.index_put_((torch.tensor([2, 2]),), torch.ones(2, 256), accumulate=True)  # the daemon's sum
        assert torch.equal(c.get("neg"), tab)
        moved = _socket_bytes(c) - sock0
        assert moved < (256 << 10), f"{moved} bytes crossed the socket"  # requests and replies only
        assert c.shm_bytes >= 5 * n * 4  # two puts, three whole gets
        c.delete("neg")
    wanted = {
        f'tensorwire_bytes_total{{direction="{direction}",transport="shm"}}': least
        for direction, least in (("in", 2 * n * 4), ("out", 3 * n * 4))
    }
    # The daemon folds a closed session's counts in once its worker has released it, which may come just
    # after the client's close returned: a scrape then sees them a moment later (counters never lose them).
    deadline = time.monotonic() + 10
    while True:
        body = _metrics(srv)
        short = {k: _metric(body, k) - _metric(body0, k) for k, least in wanted.items()}
        if all(short[k] >= least for k, least in wanted.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for key, least in wanted.items():
        assert short[key] >= least, (key, short[key])
    assert 'tensorwire_transfers_total{direction="out",transport="shm"}' in body


@pytest.mark.timeout(120)
def test_every_dtype_and_shape_round_trips_bit_exact_over_shm(srv):
    g = torch.Generator().manual_seed(7)
    with Client(srv.address, transport="shm") as c:
        for dtype in ALL_DTYPES:
            item = torch.empty(0, dtype=dtype).element_size()
            if dtype == torch.bool:
                x = torch.randint(0, 2, (33, 7), generator=g).bool()
            else:  # any bit pattern: NaN payloads, infinities, denormals, negative zero
                x = torch.randint(0, 256, (33, 7 * item), dtype=torch.uint8, generator=g).view(dtype)
            name = f"bits/{dtype}"
            c.put(name, x)
            assert torch.equal(c.get(name).view(torch.uint8), x.view(torch.uint8)), dtype
            out = torch.empty_like(x)
            c.get(name, out=out)
            assert torch.equal(out.view(torch.uint8), x.view(torch.uint8)), dtype
            idx = torch.tensor([32, 0, 5, 5, 17])
            assert torch.equal(c.get_rows(name, idx).view(torch.uint8), x[idx].view(torch.uint8)), dtype
            rows = x[[1, 2]].flip(0).contiguous()
            c.put_rows(name, [3, 4], rows)
            x[[3, 4]] = rows
            if dtype != torch.bool:
                small = torch.randint(0, 3, (2, 7), generator=g).to(dtype)
                y = torch.randint(0, 5, (33, 7), generator=g).to(dtype)  # finite values for arithmetic
                c.put(name, y)
                c.add_rows(name, [6, 6], small)
                y.index_put_((torch.tensor([6, 6]),), small, accumulate=True)
                x = y
            assert torch.equal(c.get(name).view(torch.uint8), x.view(torch.uint8)), dtype
            c.delete(name)
        # shapes: 0-d, empty, rank 8, a non-contiguous source and destination
        c.put("bits/0d", torch.tensor(2.5, dtype=torch.float64))
        assert c.get("bits/0d").item() == 2.5
        c.put("bits/empty", torch.zeros(0, 5))  # no bytes: no region, served over the connection
        assert c.get("bits/empty").shape == (0, 5) and c.get_rows("bits/empty", []).shape == (0, 5)
        r8 = torch.arange(256, dtype=torch.int16).reshape((2,) * 8)
        c.put("bits/r8", r8)
        assert torch.equal(c.get("bits/r8"), r8)
        nc = torch.arange(24.0).reshape(4, 6).t()
        c.put("bits/nc", nc)
        dst = torch.empty(4, 6).t()
        assert torch.equal(c.get("bits/nc", out=dst), nc) and torch.equal(dst, nc)
        assert c.shm


# -- pins: a reader never sees a slot rewritten under it ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_pinned_version_is_not_overwritten_and_release_frees_it(srv):
    n = 1 << 20
    with Client(srv.address, transport="shm") as w, Client(srv.address, transport="shm") as r:
        w.put("pin", torch.full((n,), 1, dtype=torch.int32))
        w.put("pin", torch.full((n,), 2, dtype=torch.int32))  # both slots exist now; 2 is current
        path = r._path
        orig = path.shm_read
        pinned = threading.Event()

        def slow(pr, rep, name, use):  # the reader holds its pin (and copies only) after a pause
            def later(src):
                pinned.set()
                time.sleep(1.0)
                return use(src)

            return orig(pr, rep, name, later)

        path.shm_read = slow
        got: list = []
        th = threading.Thread(target=lambda: got.append(r.get("pin")))
        th.start()
        try:
            assert pinned.wait(10)
            w.put("pin", torch.full((n,), 3, dtype=torch.int32))  # into the other slot: no wait
            t0 = time.monotonic()
            w.put("pin", torch.full((n,), 4, dtype=torch.int32))  # into the pinned slot: waits for the release
            waited = time.monotonic() - t0
        finally:
            th.join(30)
        path.shm_read = orig
        assert bool((got[0] == 2).all()), "the reader saw a slot rewritten under it"
        assert waited > 0.3, waited
        # an idle reader holds nothing: RELEASE went out after its copy
        assert torch.equal(r.get("pin"), torch.full((n,), 4, dtype=torch.int32))
        t0 = time.monotonic()
        for v in (5, 6, 7):
            w.put("pin", torch.full((n,), v, dtype=torch.int32))
        assert time.monotonic() - t0 < 5
        w.delete("pin")


# -- a client killed mid-write -------------------------------------------------------------------------------------

_MID_WRITE_CLIENT = r"""
import sys, time, torch
import tensorwire as tw
from tensorwire.serve.client.shm_path import ShmPath

op = sys.argv[2]
c = tw.Client(sys.argv[1], transport="shm")
c.put("victim", torch.full((1024, 256), 1.0))
orig = ShmPath.write_shm

def stall(self, pr, wop, rep, name, nbytes, fill):
    def half(dst):
        dst[: nbytes // 2].fill_(0xAB)  # garbage into the reserved region, then stall before COMMIT
        print("MIDWRITE", flush=True)
        time.sleep(600)
    return orig(self, pr, wop, rep, name, nbytes, half)

ShmPath.write_shm = stall
if op == "put":
    c.put("victim", torch.full((1024, 256), 2.0))
else:
    c.add_rows("victim", torch.arange(1024), torch.full((1024, 256), 5.0))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["put", "add_rows"])
def test_client_killed_mid_write_over_shm_leaves_previous_version(op):
    with Daemon("--transport", "auto") as d:
        child = subprocess.Popen(
            [sys.executable, "-c", _MID_WRITE_CLIENT, d.address, op],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=clean_env(),
            text=True,
        )
        try:
            line = child.stdout.readline()
            assert line.strip() == "MIDWRITE", child.stderr.read()
            with Client(d.address, transport="shm") as c:
                assert c.stat("victim").version == 1  # nothing committed
                assert torch.equal(c.get("victim"), torch.full((1024, 256), 1.0))
                child.send_signal(signal.SIGKILL)
                child.wait(10)
                assert torch.equal(c.get("victim"), torch.full((1024, 256), 1.0)), "the previous version was damaged"
                st = c.put("victim", torch.full((1024, 256), 3.0))  # the reservation was released
                assert st.version == 2
                assert torch.equal(c.get("victim"), torch.full((1024, 256), 3.0))
                c.add_rows("victim", [0], torch.ones(1, 256))
                assert c.get_rows("victim", [0, 1]).tolist() == [[4.0] * 256, [3.0] * 256]
        finally:
            child.kill()
            child.wait(10)
            child.stdout.close()
            child.stderr.close()


@pytest.mark.timeout(60)
def test_an_uncommitted_shm_write_is_dropped_by_the_reaper():
    with (
        in_process() as s,
        Client(s.address, transport="shm", timeout=1.0) as c,
        Client(s.address, transport="shm") as other,
    ):
        c._session()
        rep = c._path.call(
            Progress(), wire.OP_PUT, "stuck", dtype=wire.dtype_code("float32"), shape=(4,), flags=wire.FLAG_SHM
        )
        assert rep.status == wire.SHM  # reserved; never committed
        sid = c._sid
        assert other.stat("stuck").version == 0
        time.sleep(1.2)
        s.service.reap(3600.0)  # what the reaper thread does every 5 s
        assert all(x.id != sid for x in s.service.sessions())
        assert other.put("stuck", torch.ones(4)).version == 1 and torch.equal(other.get("stuck"), torch.ones(4))


# -- fallbacks --------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["flag", "env"])
def test_no_shm_daemon_serves_over_the_socket_and_shm_transport_is_a_clear_error(how):
    args, env = (("--no-shm",), None) if how == "flag" else ((), {"TENSORWIRE_SHM": "0"})
    with Daemon(*args, env=env) as d:
        assert d.info["shm"] is False
        with Client(d.address) as c:
            assert not c.shm and c.data_path == "tcp"
            x = torch.randn(1000, 16)
            c.put("plain", x)
            assert torch.equal(c.get("plain"), x) and torch.equal(c.get_rows("plain", [9, 1]), x[[9, 1]])
            assert c.shm_bytes == 0
        with pytest.raises(tw.ConfigError, match="transport='shm'.*offers no shared memory"):
            Client(d.address, transport="shm")
        assert not [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"tensorwire-{d.info['pid']}-")]


@pytest.mark.timeout(60)
def test_shm_transport_needs_data_requests(srv):
    with pytest.raises(tw.ConfigError, match="transport='shm'.*data_requests=False"):
        Client(srv.address, transport="shm", data_requests=False)
    with Client(srv.address, transport="tcp") as c:  # an explicit socket never offers shared memory
        assert not c.shm and c.data_path == "tcp"


@pytest.mark.timeout(60)
def test_hello_region_out_of_reach_falls_back_silently(srv, monkeypatch, tmp_path, caplog):
    caplog.set_level("DEBUG", logger="tensorwire.serve.client")
    monkeypatch.setattr(shm_maps, "SHM_DIR", str(tmp_path))  # this client's /dev/shm is not the daemon's
    with Client(srv.address) as c:
        assert not c.shm and c.data_path == c.transport_kind and c.data_path in ("ucx", "tcp")
        assert not _session(srv, c).shm  # never proven
        x = torch.randn(300, 8)
        c.put("far", x)
        assert torch.equal(c.get("far"), x) and torch.equal(c.get_rows("far", [299]), x[[299]])
        assert not _session(srv, c).shm and _session(srv, c).shm_hello is None  # withdrawn by the first request
        c.delete("far")
    assert any("not reachable from this process" in r.getMessage() for r in caplog.records)
    # the client falls back without a warning (the in-process daemon may still log an earlier test's session)
    assert not any(r.levelname == "WARNING" and r.name.startswith("tensorwire.serve.client") for r in caplog.records)
    with pytest.raises(tw.ConfigError, match="not reachable"):
        Client(srv.address, transport="shm")


@pytest.mark.timeout(60)
def test_wrong_proof_is_refused_by_the_daemon_and_falls_back(srv, monkeypatch):
    monkeypatch.setattr(shm_maps, "read_hello", lambda name: b"\x00" * shm.HELLO_NONCE_BYTES)
    before = _metric(_metrics(srv), 'tensorwire_errors_total{kind="AuthError"}')
    with Client(srv.address) as c:
        assert not c.shm and not _session(srv, c).shm and _session(srv, c).shm_hello is None
        c.put("proof", torch.ones(3))
        assert torch.equal(c.get("proof"), torch.ones(3))
        c.delete("proof")
    assert _metric(_metrics(srv), 'tensorwire_errors_total{kind="AuthError"}') == before + 1
    with pytest.raises(tw.ConfigError, match="refused the shared-memory proof"):
        Client(srv.address, transport="shm")


@pytest.mark.timeout(60)
def test_region_unmappable_mid_operation_reruns_over_the_socket(srv, monkeypatch):
    x = torch.randn(500, 4)
    with Client(srv.address) as c:
        c.put("mid", x)
        assert c.shm
        c._mem.maps.close()  # forget the mappings: the next get maps again, and that fails

        def refuse(name, need):
            raise shm.ShmError(13, "permission denied (test)")

        monkeypatch.setattr(shm_maps, "_open_map", refuse)
        assert torch.equal(c.get("mid"), x)  # once more, on a new session, over the connection
        assert not c.shm and c.data_path in ("ucx", "tcp")
        assert torch.equal(c.get_rows("mid", [3]), x[[3]])
        c.delete("mid")


@pytest.mark.timeout(60)
def test_slots_outside_shared_memory_are_served_over_the_socket(caplog):
    caplog.set_level("WARNING", logger="tensorwire.serve")
    with in_process(max_bytes="256MiB") as s, Client(s.address, transport="shm") as c:
        s.service.store.shm.max_regions = 0  # as if /dev/shm were full: new slots are ordinary memory
        x = torch.randn(2000, 32)
        c.put("ord", x)
        c.put("ord", x + 1)
        assert torch.equal(c.get("ord"), x + 1)
        idx = torch.tensor([1999, 3, 3])
        assert torch.equal(c.get_rows("ord", idx), (x + 1)[idx])  # FALLBACK, then the request with its index
        c.put_rows("ord", [0], torch.zeros(1, 32))  # no scratch region: over the connection
        y = x + 1
        y[0] = 0
        assert torch.equal(c.get("ord"), y)
        assert c.shm and c.shm_bytes == 0
        assert any("ordinary memory" in r.getMessage() for r in caplog.records)


# -- regions: names, modes, lifetimes, accounting --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_regions_are_0600_unlinked_after_delete_and_at_shutdown_and_scratch_is_charged():
    with in_process(max_bytes="64MiB") as s:
        reg = s.service.store.shm
        prefix = reg.prefix
        assert _files(prefix) == [f"{prefix}.lock"]
        with Client(s.address, transport="shm") as c:
            tab = torch.randn(1024, 256)  # 1 MiB, reserves 2
            c.put("life", tab)
            c.put("life", tab * 2)  # the staging slot: a second region
            assert torch.equal(c.get("life"), tab * 2)
            slots = set(c._mem.regions_of["life"])
            assert len(slots) == 2
            for name in slots:
                st = os.stat(os.path.join(shm.SHM_DIR, name))
                assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
                assert shm.valid_name(name) and name.startswith(prefix + "-")
            reserved = s.service.store.reserved
            c.add_rows("life", [1, 2], torch.ones(2, 256))  # through the session's scratch region
            scratch = _session(s, c)._shm_scratch
            assert scratch is not None and os.path.exists(scratch.path)
            assert s.service.store.reserved == reserved + scratch.size  # charged against --max-bytes
            c.delete("life")
            _wait_for(
                lambda: not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in slots),
                what="the deleted tensor's regions to be unlinked",
            )
            assert os.path.exists(scratch.path)  # the session's, until it closes
        _wait_for(lambda: not os.path.exists(scratch.path), what="the scratch region to go with its session")
        # The session's thread unlinks its regions, then returns their charge: wait for both.
        _wait_for(lambda: s.service.store.reserved == 0, what="every reservation to be returned")
        c2 = Client(s.address, transport="shm")
        c2.put("kept", torch.ones(1000))
        assert len(_files(prefix)) >= 2
    assert _files(prefix) == [], "regions left after shutdown"
    c2.close()


@pytest.mark.timeout(120)
def test_daemon_exit_leaves_nothing_and_a_sigkilled_daemons_files_are_cleaned_by_the_next():
    def prefix_of(c: Client) -> str:
        return next(iter(c._mem.maps.names())).rsplit("-", 1)[0]

    with Daemon() as d:
        with Client(d.address, transport="shm") as c:
            c.put("x", torch.ones(4096))
            c.get("x")
            prefix = prefix_of(c)
        assert len(_files(prefix)) >= 2
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0, d.log()
    assert _files(prefix) == []
    with Daemon() as d:
        with Client(d.address, transport="shm") as c:
            c.put("x", torch.ones(4096))
            prefix = prefix_of(c)
        d.signal(signal.SIGKILL)
        d.wait(30)
    left = _files(prefix)
    assert f"{prefix}.lock" in left and len(left) >= 2  # what a SIGKILL leaves behind
    with Daemon() as d2:
        assert _files(prefix) == [], "the next daemon did not remove a dead daemon's regions"
        assert "removed" in d2.log()


@pytest.mark.timeout(60)
def test_stale_cleanup_spares_live_daemons_and_other_files(tmp_path):
    live = daemon_shm.Registry(str(tmp_path))
    try:
        r = live.create(100)
        dead = tmp_path / "tensorwire-999999999-0123abcd-0123456789abcdef01234567"  # no lock, no such pid
        dead.write_bytes(b"x")
        other = tmp_path / "someone-elses-file"
        other.write_bytes(b"y")
        assert daemon_shm.clean_stale(str(tmp_path)) == 1
        assert os.path.exists(r.path) and os.path.exists(tmp_path / f"{live.prefix}.lock") and other.exists()
        assert not dead.exists()
    finally:
        live.close()
    assert sorted(os.listdir(tmp_path)) == ["someone-elses-file"]


# -- the checks on both sides -----------------------------------------------------------------------------------------


def test_client_maps_only_region_names():
    maps = shm_maps.ClientMaps()
    for bad in (
        "../../etc/passwd",
        "/dev/shm/tensorwire-1-00000000-000000000000000000000000",
        "tensorwire-1-x-y",
        "tensorwire-1-00000000-000000000000000000000000/../../x",
        "",
    ):
        assert not shm.valid_name(bad)
        with pytest.raises(shm.ShmError):
            maps.get(bad, 0, 1)
    with pytest.raises(shm.ShmError):  # well-formed, but not there
        maps.get("tensorwire-1-00000000-000000000000000000000000", 0, 1)


def _send_raw(c: Client, payload: bytes) -> None:
    _, t = c._session()
    c._path.req_id += 1
    t.send(TAG_REQUEST, torch.tensor(list(payload), dtype=torch.uint8), step=c._path.req_id, timeout=10)


def _request(op: int, name: bytes, *, flags: int = 0, shape: tuple[int, ...] = ()) -> bytes:
    buf = bytearray(wire.request_size(len(name), 0))
    wire.pack_request(memoryview(buf), op=op, req_id=1, name=name, flags=flags, shape=shape)
    return bytes(buf)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "case", ["flag without shm", "commit without shm", "release without shm", "release of nothing"]
)
def test_shm_requests_out_of_place_close_only_their_session(srv, case, caplog):
    caplog.set_level("WARNING", logger="tensorwire.serve.daemon.session")
    kind = "shm" if case == "release of nothing" else "tcp"
    payload = {
        "flag without shm": _request(wire.OP_GET, b"x", flags=wire.FLAG_SHM),
        "commit without shm": _request(wire.OP_COMMIT, b"x"),
        "release without shm": _request(wire.OP_RELEASE, b"x"),
        "release of nothing": _request(wire.OP_RELEASE, b"x"),
    }[case]
    with Client(srv.address, transport=kind) as c, Client(srv.address, transport="shm") as other:
        c.put("x", torch.ones(2))
        sid = c._sid
        _send_raw(c, payload)
        _wait_for(lambda: all(s.id != sid for s in srv.service.sessions()), what="the session to close")
        assert f"session {sid[:8]} closed: malformed data-plane request" in caplog.text
        assert torch.equal(other.get("x"), torch.ones(2)) and torch.equal(c.get("x"), torch.ones(2))


@pytest.mark.timeout(60)
def test_wire_checks_of_the_shm_fields():
    ok = wire.parse_request(memoryview(_request(wire.OP_GET_ROWS, b"t", flags=wire.FLAG_SHM, shape=(5,))))
    assert ok.shm and ok.shape == (5,) and ok.nindex == 0
    for bad in (
        _request(wire.OP_GET_ROWS, b"t", flags=wire.FLAG_SHM),  # no row count
        _request(wire.OP_GET_ROWS, b"t", flags=wire.FLAG_SHM, shape=(-1,)),
        _request(wire.OP_GET, b"t", flags=0x02),  # unknown flag
        _request(wire.OP_RELEASE, b"t", flags=wire.FLAG_SHM),
        _request(wire.OP_GET, b"t", shape=(3,)),
    ):
        with pytest.raises(wire.MalformedRequest):
            wire.parse_request(memoryview(bad))
    buf = bytearray(wire.REPLY_BYTES)
    wire.pack_reply(
        memoryview(buf),
        status=wire.SHM,
        op=wire.OP_GET,
        req_id=3,
        nbytes=10,
        chunk=4096,
        message="tensorwire-1-00000000-000000000000000000000000",
    )
    rep = wire.parse_reply(memoryview(buf))
    assert (rep.status, rep.nbytes, rep.chunk) == (wire.SHM, 10, 4096) and shm.valid_name(rep.message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "parallel_bytes,helpers,torch_gather",
    [(0, 1, True), (0, 5, False), (1 << 40, 1, True)],
    ids=["split", "split-5-helpers-numpy-gather", "one-thread"],
)
def test_client_side_copies_and_gathers_split_or_not(srv, monkeypatch, parallel_bytes, helpers, torch_gather):
    monkeypatch.setattr(shm_maps.Copier, "TORCH_GATHER", torch_gather)
    monkeypatch.setattr(shm_maps.Copier, "SPLIT_BYTES", parallel_bytes)
    monkeypatch.setattr(shm_maps.Copier, "TAKE_SPLIT_BYTES", parallel_bytes)
    # whatever the load
    monkeypatch.setattr(shm_maps.Copier, "_split", lambda self, n, least: helpers if n >= least else 0)
    g = torch.Generator().manual_seed(11)
    with Client(srv.address, transport="shm") as c:
        for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.uint8):
            x = (torch.randn(500, 3, 5, generator=g) * 50).to(dtype)
            name = f"gather/{parallel_bytes}/{helpers}/{dtype}"
            c.put(name, x)
            for idx in ([], [0], [499, 0, 499], torch.randint(0, 500, (777,), generator=g)):
                i = torch.as_tensor(idx, dtype=torch.int64)
                assert torch.equal(c.get_rows(name, idx), x[i]), (dtype, idx)
                out = torch.empty(len(i), 3, 5, dtype=dtype)
                assert c.get_rows(name, idx, out=out) is out and torch.equal(out, x[i])
                nc = torch.empty(3, 5, len(i), dtype=dtype).permute(2, 0, 1)  # a non-contiguous out
                assert torch.equal(c.get_rows(name, idx, out=nc), x[i])
            with pytest.raises(tw.SpecError, match="out of range"):
                c.get_rows(name, [500])
            with pytest.raises(tw.SpecError, match="out of range"):
                c.get_rows(name, [-1, 3])
            y = x.flip(0)
            c.put(name, y)
            assert torch.equal(c.get(name), y)
            c.put_rows(name, [7, 1], x[:2])
            y[[7, 1]] = x[:2]
            out = torch.empty_like(y)
            assert c.get(name, out=out) is out and torch.equal(out, y)
            c.delete(name)
        big = torch.randn(4099, 1000)  # odd sizes: pieces of unequal length
        c.put("gather/big", big)
        assert torch.equal(c.get("gather/big"), big)
        idx = torch.randint(0, 4099, (3001,), generator=g)
        assert torch.equal(c.get_rows("gather/big", idx), big[idx])
        c.delete("gather/big")
        assert c.shm


@pytest.mark.timeout(60)
@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_lease_get_rows_is_torchs_index_select_over_a_view_of_the_mapped_slot(srv, monkeypatch, oversubscribed):
    # the kernel (and threads) of a local torch.index_select(table, 0, idx, out=...), reading the daemon's memory;
    # numpy's single thread where that gathered faster (cores busy with other work: an OpenMP team would spin)
    monkeypatch.setattr(shm_maps.Copier, "torch_gather", lambda self, nbytes: not oversubscribed)
    table = torch.randn(3_000, 24)
    idx = torch.randint(0, 3_000, (1_000,), generator=torch.Generator().manual_seed(3))
    with Client(srv.address, transport="shm") as c:
        c.put("lease/rows", table)
        assert torch.equal(c.get_rows("lease/rows", idx), table[idx])  # a request: pins, hands out the lease
        maps = c._mem.maps
        regions = {n: maps._maps[n][1] for n in maps.names()}
        seen: list[tuple[int, int]] = []
        real = torch.index_select
        monkeypatch.setattr(
            torch,
            "index_select",
            lambda src, *a, **kw: seen.append((src.data_ptr(), src.nbytes)) or real(src, *a, **kw),
        )
        reads = c.lease_reads
        out = torch.empty(1_000, 24)
        assert c.get_rows("lease/rows", idx, out=out) is out and torch.equal(out, table[idx])
        assert c.lease_reads == reads + 1
        if oversubscribed:
            assert not seen
            c.delete("lease/rows")
            return
        ((ptr, nbytes),) = seen
        assert nbytes == table.nbytes
        assert any(r.data_ptr() <= ptr and ptr + nbytes <= r.data_ptr() + r.numel() for r in regions.values())
        c.delete("lease/rows")
