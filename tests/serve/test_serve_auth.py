"""Token auth on every control call, TLS and mTLS, and the data-plane session credential."""

from __future__ import annotations

import grpc
import pytest
import torch

import tensorwire as tw
from tensorwire._proto import spec_to_proto
from tensorwire.serve import TLSConfig
from tensorwire.serve.client.client import Client
from tensorwire.v1 import store_pb2, store_pb2_grpc

from serve_common import Daemon, in_process, make_pki

TOKEN = "correct-horse-battery-staple-0123456789"


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    f = tmp_path_factory.mktemp("tok") / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    with in_process(token_file=str(f)) as s:
        with Client(s.address, token=TOKEN, transport="tcp") as c:
            c.put("secret", torch.arange(10))
        yield s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", TOKEN[:-1]])
def test_wrong_or_missing_token_is_auth_error(token_server, token):
    with pytest.raises(tw.AuthError):
        Client(token_server.address, token=token, transport="tcp")


@pytest.mark.timeout(60)
def test_every_control_call_needs_the_token_and_nothing_is_served(token_server):
    with grpc.insecure_channel(token_server.address) as ch:
        stub = store_pb2_grpc.StoreStub(ch)
        calls = [
            (stub.List, store_pb2.ListRequest()),
            (stub.Stat, store_pb2.StatRequest(name="secret")),
            (stub.Delete, store_pb2.DeleteRequest(name="secret")),
            (stub.Declare, store_pb2.DeclareRequest(spec=spec_to_proto(tw.TensorSpec("x", (1 << 20,))))),
            (stub.OpenSession, store_pb2.OpenSessionRequest()),
            (stub.Snapshot, store_pb2.SnapshotRequest()),
        ]
        for fn, req in calls:
            for md in [(), (("authorization", "Bearer nope"),), (("authorization", TOKEN),)]:
                with pytest.raises(grpc.RpcError) as ei:
                    fn(req, timeout=5, metadata=md)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the health service stays open for probes
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            == health_pb2.HealthCheckResponse.SERVING
        )
    with Client(token_server.address, token=TOKEN, transport="tcp") as c:
        assert set(c.list()) == {"secret"} and torch.equal(c.get("secret"), torch.arange(10))


@pytest.mark.timeout(60)
def test_data_connection_needs_the_session_nonce(token_server):
    from tensorwire.transport.base import new_nonce
    from tensorwire.transport.tcp import TcpListener

    with Client(token_server.address, token=TOKEN, transport="tcp") as c:
        host, port = token_server.ready_info()["data"][0]["host"], token_server.ready_info()["data"][0]["port"]
        with pytest.raises(tw.AuthError):
            TcpListener.connect(host, port, new_nonce(), timeout=5)
        assert torch.equal(c.get("secret"), torch.arange(10))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.timeout(60)
def test_tls_right_ca_works_wrong_ca_or_plaintext_is_auth_error(pki):
    with in_process(tls_cert=pki["server.pem"], tls_key=pki["server.key"]) as s:
        with Client(s.address, tls={"ca": pki["ca1.pem"]}, transport="tcp") as c:
            c.put("t", torch.ones(3))
            assert torch.equal(c.get("t"), torch.ones(3))
        with pytest.raises(tw.AuthError):
            Client(s.address, tls={"ca": pki["ca2.pem"]}, transport="tcp")
        with pytest.raises(tw.AuthError):
            Client(s.address, transport="tcp")  # plaintext to a TLS server
    with in_process() as plain:
        with pytest.raises(tw.AuthError):
            Client(plain.address, tls={"ca": pki["ca1.pem"]}, transport="tcp")  # TLS to a plaintext server


@pytest.mark.timeout(60)
def test_mtls_requires_a_client_certificate_from_the_ca(pki):
    with in_process(tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_ca=pki["ca1.pem"]) as s:
        tls = TLSConfig(ca=pki["ca1.pem"], cert=pki["client.pem"], key=pki["client.key"])
        with Client(s.address, tls=tls, transport="tcp") as c:
            c.put("m", torch.zeros(2))
        with pytest.raises(tw.AuthError):
            Client(s.address, tls={"ca": pki["ca1.pem"]}, transport="tcp")  # no client certificate
        with pytest.raises(tw.AuthError):
            Client(
                s.address,
                tls={"ca": pki["ca2.pem"], "cert": pki["client.pem"], "key": pki["client.key"]},
                transport="tcp",
            )


@pytest.mark.timeout(90)
def test_daemon_with_token_and_tls_on_a_public_bind(tmp_path, pki):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    with Daemon(
        "--host", "0.0.0.0", "--token-file", str(token), "--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"]
    ) as d:
        addr = f"localhost:{d.port}"
        with Client(addr, token=TOKEN, tls={"ca": pki["ca1.pem"]}, transport="tcp") as c:
            c.put("p", torch.arange(4))
            assert torch.equal(c.get("p"), torch.arange(4))
        with pytest.raises(tw.AuthError):
            Client(addr, token="bad", tls={"ca": pki["ca1.pem"]}, transport="tcp")
