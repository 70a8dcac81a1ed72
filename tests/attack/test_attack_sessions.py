"""Attacks on sessions: one data-plane credential raced over many connections, one client taking every session.

- A session's nonce admits exactly one data connection, however many present it at the same instant
  (the listener checks and claims it in one step).
- One client (one peer address, one local user, one client certificate) holds at most
  ``max_sessions_per_client`` sessions; past that it gets a ResourceExhaustedError that says so, and
  everyone else can still open theirs.
"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.transport.base import new_nonce
from tensorwire.v1 import store_pb2, store_pb2_grpc

from serve_common import in_process, make_pki, ucx_usable

pytestmark = pytest.mark.attack

RACERS = 12
TRIALS = 10


def _race(connect, host: str, port: int, nonce: bytes) -> tuple[list, list]:
    """``RACERS`` threads present ``nonce`` at once; returns (transports accepted, errors)."""
    barrier = threading.Barrier(RACERS)
    won: list = []
    lost: list = []
    lock = threading.Lock()

    def go() -> None:
        barrier.wait(10)
        try:
            t = connect(host, port, nonce, timeout=10)
        except tw.TensorWireError as exc:
            with lock:
                lost.append(exc)
            return
        with lock:
            won.append(t)

    threads = [threading.Thread(target=go, daemon=True) for _ in range(RACERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads), "a connect hung"
    return won, lost


def _kinds() -> list:
    ucx = pytest.param("ucx", marks=pytest.mark.skipif(not ucx_usable(), reason="UCX is not usable here"))
    return ["tcp", ucx]


def _slow_handshakes(monkeypatch) -> None:
    """Stretch the TCP listener's answer to a good hello (as a loaded machine does): a listener that checks a
    nonce and claims it in two steps then admits every racer that got between them."""
    import time

    import tensorwire.transport.tcp.listener as tcp_listener

    real = tcp_listener.tune_socket

    def slow(sock, **kw):
        time.sleep(0.02)
        return real(sock, **kw)

    monkeypatch.setattr(tcp_listener, "tune_socket", slow)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", _kinds())
def test_one_nonce_presented_on_many_simultaneous_connections_admits_exactly_one(kind, monkeypatch):
    from tensorwire.transport.base import get_factory

    if kind == "tcp":
        _slow_handshakes(monkeypatch)
    factory = get_factory(kind)
    listener = factory("127.0.0.1", port=0)
    try:
        host, port = listener.address
        for trial in range(TRIALS):
            nonce = new_nonce()
            listener.expect(nonce)
            won, lost = _race(factory.connect, host, port, nonce)
            try:
                assert len(won) == 1, f"trial {trial}: {len(won)} connections were admitted with one nonce"
                assert len(lost) == RACERS - 1
                assert all(isinstance(e, (tw.AuthError, tw.PeerLostError)) for e in lost), lost
                accepted = listener.accept(nonce, timeout=10)
                accepted.close()
                # and once used, it is spent: a later presentation is refused too
                with pytest.raises(tw.TensorWireError):
                    factory.connect(host, port, nonce, timeout=5).close()
            finally:
                for t in won:
                    t.close()
    finally:
        listener.close()


@pytest.mark.timeout(120)
def test_a_session_nonce_from_open_session_admits_one_data_connection_and_the_session_works(monkeypatch):
    from tensorwire.transport.tcp import TcpListener

    _slow_handshakes(monkeypatch)
    with in_process(transport="tcp") as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            for trial in range(5):
                resp = stub.OpenSession(store_pb2.OpenSessionRequest(transport="tcp"), timeout=10)
                addr = resp.data[0]
                won, _ = _race(TcpListener.connect, addr.host, addr.port, resp.nonce)
                try:
                    assert len(won) == 1, f"trial {trial}: {len(won)} data connections admitted for one session"
                finally:
                    for t in won:
                        t.close()
                stub.CloseSession(store_pb2.CloseSessionRequest(session_id=resp.session_id), timeout=10)
        with Client(s.address, transport="tcp") as c:  # the daemon is unharmed
            c.put("x", torch.arange(4))
            assert torch.equal(c.get("x"), torch.arange(4))


def _open(stub, n: int) -> list:
    return [stub.OpenSession(store_pb2.OpenSessionRequest(transport="tcp"), timeout=10) for _ in range(n)]


@pytest.mark.timeout(120)
def test_one_client_cannot_hold_more_than_its_cap_of_sessions_and_others_still_get_theirs():
    with in_process(transport="tcp", max_sessions=12, max_sessions_per_client=4) as s:
        with grpc.insecure_channel(s.address) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            held = _open(stub, 4)  # the flood: this client's whole allowance, never used
            with pytest.raises(grpc.RpcError) as ei:
                stub.OpenSession(store_pb2.OpenSessionRequest(transport="tcp"), timeout=10)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "per client" in ei.value.details() and "max-sessions-per-client" in ei.value.details()
            # closing one of the flood's sessions gives that client one back
            stub.CloseSession(store_pb2.CloseSessionRequest(session_id=held[0].session_id), timeout=10)
            held[0] = stub.OpenSession(store_pb2.OpenSessionRequest(transport="tcp"), timeout=10)
            for r in held:
                stub.CloseSession(store_pb2.CloseSessionRequest(session_id=r.session_id), timeout=10)


@pytest.mark.timeout(120)
def test_a_session_flood_from_one_peer_leaves_room_for_other_peers(monkeypatch):
    """Two identities, as the daemon tells them apart: the flooding one hits its cap, the other one works."""
    with in_process(transport="tcp", max_sessions=8, max_sessions_per_client=6) as s:
        svc = s.service
        assert svc is not None
        with grpc.insecure_channel(s.address) as ch:
            stub = store_pb2_grpc.StoreStub(ch)
            flood = []
            with pytest.raises(grpc.RpcError) as ei:
                for _ in range(50):
                    flood.append(stub.OpenSession(store_pb2.OpenSessionRequest(transport="tcp"), timeout=10))
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(flood) == 6
            # now the same daemon sees the next caller as someone else (another host or user)
            monkeypatch.setattr(svc, "_client_key", lambda context: "addr:192.0.2.7")
            with Client(s.address, transport="tcp") as c:
                c.put("y", torch.ones(3))
                assert torch.equal(c.get("y"), torch.ones(3))
            for r in flood:
                stub.CloseSession(store_pb2.CloseSessionRequest(session_id=r.session_id), timeout=10)


class _Ctx:
    def __init__(self, peer: str, ids=None) -> None:
        self._peer, self._ids = peer, ids

    def peer(self) -> str:
        return self._peer

    def peer_identities(self):
        return self._ids


def test_parse_peer_reads_grpc_peer_strings_and_refuses_the_rest():
    from tensorwire.serve.daemon.peers import parse_peer

    assert parse_peer("ipv4:127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_peer("ipv6:[::1]:6000") == ("::1", 6000)
    assert parse_peer("unix:/tmp/sock") is None
    assert parse_peer("ipv4:not-an-ip:1") is None
    assert parse_peer("ipv4:127.0.0.1:port") is None


def test_client_key_is_the_local_user_on_loopback_the_address_elsewhere_and_the_certificate_under_mtls():
    import os
    import socket

    from tensorwire.serve.daemon.peers import client_key

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname(), timeout=5)
    conn, _ = srv.accept()
    try:
        port = srv.getsockname()[1]
        local = cli.getsockname()[1]
        assert client_key(_Ctx(f"ipv4:127.0.0.1:{local}"), server_port=port) == f"uid:{os.getuid()}"
        assert client_key(_Ctx(f"ipv6:[::ffff:127.0.0.1]:{local}"), server_port=port) == f"uid:{os.getuid()}"
        # a port no socket of this host has: the address stands for the client
        assert client_key(_Ctx("ipv4:127.0.0.1:1"), server_port=port) == "addr:127.0.0.1"
    finally:
        for s in (cli, conn, srv):
            s.close()
    assert client_key(_Ctx("ipv4:192.0.2.7:4242")) == "addr:192.0.2.7"
    assert client_key(_Ctx("ipv4:192.0.2.7:4242", [b"client-a"])) == "cert:client-a"


def test_max_sessions_per_client_comes_from_flag_or_env_and_is_validated():
    from tensorwire.serve.daemon.config import ServeConfig

    assert ServeConfig.resolve({}, {}).max_sessions_per_client == 64
    assert ServeConfig.resolve({}, {"TENSORWIRE_MAX_SESSIONS_PER_CLIENT": "5"}).max_sessions_per_client == 5
    assert (
        ServeConfig.resolve(
            {"max_sessions_per_client": 7}, {"TENSORWIRE_MAX_SESSIONS_PER_CLIENT": "5"}
        ).max_sessions_per_client
        == 7
    )
    assert ServeConfig(max_sessions=10, max_sessions_per_client=64).max_sessions_per_client == 10
    for bad in (0, -1, True):
        with pytest.raises(tw.ConfigError, match="max_sessions_per_client"):
            ServeConfig(max_sessions_per_client=bad)


@pytest.mark.timeout(60)
def test_under_mtls_a_client_is_counted_by_its_certificate(tmp_path):
    pki = make_pki(tmp_path)
    with in_process(
        tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_ca=pki["ca1.pem"], max_sessions_per_client=1
    ) as s:
        tls = {"ca": pki["ca1.pem"], "cert": pki["client.pem"], "key": pki["client.key"]}
        with Client(s.address, tls=tls, transport="tcp") as c:
            c.put("m", torch.zeros(2))
            svc = s.service
            assert svc is not None
            owners = set(svc._owner.values())
            assert len(owners) == 1 and next(iter(owners)).startswith("cert:"), owners
            with pytest.raises(tw.ResourceExhaustedError, match="per client"):
                with Client(s.address, tls=tls, transport="tcp") as c2:
                    c2.put("n", torch.zeros(2))
