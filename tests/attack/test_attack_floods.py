"""Connection floods on every port of the daemon, and writers waiting on a reserved name.

Idle, unauthenticated connections to the data port must not keep clients
out; one refused for load hears BUSY (and retries), one with a bad credential
hears NO; idle connections to the gRPC port must not slow the control plane;
BeginPut calls waiting on a name must not tie up the gRPC handler threads.
All traffic goes to 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest
import torch

import tensorwire as tw
from tensorwire._proto import spec_to_proto
from flood import Flood, raise_nofile
from serve_common import Daemon, in_process
from tensorwire.transport.admission import AdmissionLimits, PendingTable
from tensorwire.transport.base import new_nonce
from tensorwire.transport.tcp import HELLO, HELLO_HEAD, HELLO_MAGIC, PROTOCOL_VERSION, TcpListener

pytestmark = [pytest.mark.attack, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True, scope="module")
def _enough_descriptors():
    raise_nofile(8192)


def _client_roundtrip(address: str, i: int) -> None:
    with tw.Client(address, transport="tcp", connect_timeout=10, timeout=20, name=f"legit-{i}") as c:
        t = torch.full((256,), float(i))
        c.put(f"t{i}", t)
        assert torch.equal(c.get(f"t{i}"), t)


def test_an_idle_flood_on_the_data_port_does_not_keep_tcp_clients_out():
    # the case: 200 idle connections refreshed every few seconds made 37 of 40 clients fail
    with Daemon("--no-shm", transport="tcp") as d:
        data_port = d.info["data"][0]["port"]
        with Flood(data_port, 300, refresh=1.5) as flood:
            time.sleep(0.5)
            errors: list[BaseException] = []
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                for f in [pool.submit(_client_roundtrip, d.address, i) for i in range(24)]:
                    try:
                        f.result(60)
                    except BaseException as exc:  # noqa: BLE001 - counted below
                        errors.append(exc)
            assert flood.opened >= 300
        assert not errors, f"{len(errors)} of 24 clients failed under the flood, e.g. {errors[0]!r}"
        assert d.proc.poll() is None, d.log()


def test_the_oldest_idle_connection_is_evicted_with_busy_and_a_real_client_gets_in():
    lst = TcpListener("127.0.0.1", port=0, limits=AdmissionLimits(hello_timeout=30.0, total=4, per_peer=4))
    idle = []
    try:
        for _ in range(4):
            s = socket.create_connection(lst.address, timeout=5)
            idle.append(s)
        deadline = time.monotonic() + 5
        while lst.pending < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lst.pending == 4
        nonce = new_nonce()
        lst.expect(nonce)
        out: dict = {}
        th = threading.Thread(
            target=lambda: out.setdefault("c", TcpListener.connect("127.0.0.1", lst.address[1], nonce, timeout=10))
        )
        th.start()
        server = lst.accept(nonce, timeout=10)
        th.join(10)
        out["c"].close()
        server.close()
        idle[0].settimeout(5)
        assert idle[0].recv(8)[:4] == b"TWBZ"  # the oldest idle one made room and was told why
        assert lst.evicted == 1 and lst.pending == 3
    finally:
        for s in idle:
            s.close()
        lst.close()


def test_a_client_refused_for_load_retries_then_raises_resource_exhausted():
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    seen = []

    def busy_forever() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except socket.timeout:
                continue
            seen.append(1)
            c.recv(HELLO.size)
            c.sendall(b"TWBZ" + (20).to_bytes(4, "little"))
            c.close()

    th = threading.Thread(target=busy_forever, daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(tw.ResourceExhaustedError, match="busy"):
            TcpListener.connect("127.0.0.1", srv.getsockname()[1], new_nonce(), timeout=1.0)
        assert time.monotonic() - t0 < 3
        assert len(seen) >= 3  # it dialled again, with backoff
    finally:
        stop.set()
        th.join(5)
        srv.close()


def test_a_bad_credential_is_refused_with_an_answer_not_a_dropped_connection():
    lst = TcpListener("127.0.0.1", port=0)
    try:
        with pytest.raises(tw.AuthError, match="refused the credential"):
            TcpListener.connect("127.0.0.1", lst.address[1], new_nonce(), timeout=5)
        s = socket.create_connection(lst.address, timeout=5)
        s.sendall(HELLO_HEAD.pack(HELLO_MAGIC, PROTOCOL_VERSION + 3, b"\0" * 16))
        assert s.recv(8)[:4] == b"TWNO"
        s.close()
    finally:
        lst.close()


def test_pending_table_evicts_from_the_heaviest_address_and_expires_in_order():
    t: PendingTable[int] = PendingTable(AdmissionLimits(hello_timeout=1.0, total=4, per_peer=2))
    assert t.add(1, "a", 0.0) == [] and t.add(2, "a", 0.1) == [] and t.add(3, "b", 0.2) == []
    assert t.add(4, "a", 0.3) == [1]  # per-peer cap: a's oldest
    assert t.add(5, "c", 0.4) == []
    assert t.add(6, "d", 0.5) == [2]  # total cap: the heaviest address (a) loses its oldest, not b, c or d
    assert sorted(t.keys()) == [3, 4, 5, 6] and t.pending_from("b") == 1
    assert t.next_deadline() == pytest.approx(1.2)
    assert sorted(t.expired_keys(1.35)) == [3, 4] and len(t) == 2 and t.expired == 2 and t.evicted == 2


def test_an_idle_flood_on_the_grpc_port_does_not_slow_the_control_plane():
    with Daemon("--no-shm", transport="tcp") as d, tw.Client(d.address, transport="tcp") as c:
        c.put("x", torch.ones(16))
        t0 = time.monotonic()
        c.list()
        base = time.monotonic() - t0
        with Flood(d.port, 1000, refresh=3.0):
            time.sleep(1.0)
            t0 = time.monotonic()
            with tw.Client(d.address, transport="tcp", connect_timeout=10) as c2:
                assert "x" in c2.list()
                assert torch.equal(c2.get("x"), torch.ones(16))
            loaded = time.monotonic() - t0
        assert loaded < 5.0, (
            f"a new client took {loaded:.2f}s under 1000 idle gRPC connections (list alone: {base:.3f}s)"
        )
        assert d.proc.poll() is None, d.log()


def _waiting_begin_puts(address: str, n: int, name: str) -> tuple[list, list]:
    """``n`` raw sessions each calling BeginPut on ``name`` (held by another writer) with a 60 s timeout."""
    import grpc

    from tensorwire.serve.protocol.common import PROTOCOL_VERSION as STORE_PROTOCOL
    from tensorwire.spec import TensorSpec
    from tensorwire.v1 import store_pb2, store_pb2_grpc

    ch = grpc.insecure_channel(address)
    stub = store_pb2_grpc.StoreStub(ch)
    spec = spec_to_proto(TensorSpec(name, (1024,), "float32"))
    futs = []
    for _ in range(n):
        sid = stub.OpenSession(
            store_pb2.OpenSessionRequest(protocol_version=STORE_PROTOCOL, transport="tcp"), timeout=10
        ).session_id
        futs.append(
            stub.BeginPut.future(store_pb2.BeginPutRequest(session_id=sid, spec=spec, timeout_ms=60_000), timeout=70)
        )
    return [ch], futs


def test_begin_put_calls_waiting_on_a_reserved_name_leave_the_control_plane_answering():
    with in_process(workers=8, transport="tcp") as s:
        holder = tw.Client(s.address, transport="tcp", data_requests=False)
        try:
            holder.put("hot", torch.zeros(1024))
            # reserve "hot" for a put whose bytes never come: BeginPut through the raw call
            from tensorwire.v1 import store_pb2

            sid, _ = holder._session()
            holder._ctx.stub.BeginPut(
                store_pb2.BeginPutRequest(
                    session_id=sid, spec=spec_to_proto(tw.TensorSpec("hot", (1024,), "float32")), timeout_ms=60_000
                ),
                timeout=10,
            )
            chans, futs = _waiting_begin_puts(s.address, 40, "hot")
            time.sleep(1.0)  # the waiters are in: before the fix they held every handler thread
            t0 = time.monotonic()
            with tw.Client(s.address, transport="tcp", connect_timeout=5, timeout=5) as other:
                assert "hot" in other.list()
                other.put("cold", torch.ones(8))
            took = time.monotonic() - t0
            assert took < 3.0, f"the control plane took {took:.2f}s to answer while writers waited"
            # the waiters were told to retry (Busy), none holds a handler thread for its whole timeout
            done = [f for f in futs if f.done()]
            assert len(done) == len(futs), f"{len(futs) - len(done)} BeginPut calls still held a handler thread"
            for f in futs:
                f.cancel()
            for ch in chans:
                ch.close()
        finally:
            holder.close()
