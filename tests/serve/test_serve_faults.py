"""Faults: clients and daemons killed, signals, garbage on both ports, fuzzed control messages."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorwire as tw
from tensorwire._proto import spec_to_proto
from tensorwire.serve.client.client import Client
from tensorwire.v1 import store_pb2, store_pb2_grpc, types_pb2

from serve_common import ROOT, Daemon, clean_env, in_process

# A client that sends the header and half of a 4 MiB put, says so, and stalls until killed.
_MID_PUT_CLIENT = r"""
import sys, time, torch
import tensorwire as tw
from tensorwire.transport import tcp

c = tw.Client(sys.argv[1], transport="tcp")
c.put("victim", torch.full((1 << 20,), 1.0))
orig = tcp.TcpTransport._write

def half(self, views, deadline):
    if sum(len(v) for v in views) > (1 << 20):
        payload = views[-1]
        orig(self, views[:-1] + [payload[: len(payload) // 2]], deadline)
        print("MIDPUT", flush=True)
        time.sleep(600)
    return orig(self, views, deadline)

tcp.TcpTransport._write = half
c.put("victim", torch.full((1 << 20,), 2.0))
"""


@pytest.mark.timeout(120)
def test_client_killed_mid_put_leaves_previous_version_and_daemon_serving():
    with Daemon() as d:
        child = subprocess.Popen(
            [sys.executable, "-c", _MID_PUT_CLIENT, d.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=clean_env(),
            text=True,
        )
        try:
            line = child.stdout.readline()
            assert line.strip() == "MIDPUT", child.stderr.read()
            with Client(d.address, transport="tcp") as c:
                assert c.stat("victim").version == 1  # the half-sent put is not visible
                child.send_signal(signal.SIGKILL)
                child.wait(10)
                got = c.get("victim")
                assert torch.equal(got, torch.full((1 << 20,), 1.0)), "the previous version was damaged"
                st = c.put("victim", torch.full((1 << 20,), 3.0))  # the staging slot was released
                assert st.version == 2
                assert torch.equal(c.get("victim"), torch.full((1 << 20,), 3.0))
            assert "transfer failed" in d.log() or "connection lost" in d.log()
        finally:
            child.kill()
            child.wait(10)
            child.stdout.close()
            child.stderr.close()


@pytest.mark.timeout(120)
def test_daemon_sigkilled_and_restarted_restores_what_was_snapshotted(tmp_path):
    snap = str(tmp_path / "snap")
    x = torch.randn(100, 7)
    with Daemon("--snapshot-dir", snap) as d:
        with Client(d.address, transport="tcp") as c:
            c.put("keep", x)
            c.put("keep", x * 2)
            c.put("ints", torch.arange(10))
            info = c.snapshot()
            assert info.tensors == 2
            c.put("keep", x * 5)  # after the snapshot: lost with the kill
            c.put("later", torch.ones(3))
        d.signal(signal.SIGKILL)
        d.wait(10)
    # a snapshot interrupted mid-write leaves only a temp file: cleaned up, the previous one stands
    (tmp_path / "snap" / ".store.safetensors.999.tmp").write_bytes(b"partial garbage")
    with Daemon("--snapshot-dir", snap) as d2:
        assert d2.info["restored"] == 2
        with Client(d2.address, transport="tcp") as c:
            assert torch.equal(c.get("keep"), x * 2) and c.stat("keep").version == 2
            assert torch.equal(c.get("ints"), torch.arange(10))
            assert "later" not in c.list()
        assert not (tmp_path / "snap" / ".store.safetensors.999.tmp").exists()


@pytest.mark.timeout(120)
def test_sigterm_drains_snapshots_and_exits_0_then_restart_restores(tmp_path):
    snap = str(tmp_path / "snap")
    with Daemon("--snapshot-dir", snap) as d:
        with Client(d.address, transport="tcp") as c:
            c.put("w", torch.arange(6.0))
            c.add_rows("w", [0], torch.ones(1))
        d.signal(signal.SIGTERM)
        assert d.wait(60) == 0, d.log()
        assert "snapshot:" in d.log()
    with Daemon("--snapshot-dir", snap) as d2, Client(d2.address, transport="tcp") as c:
        assert torch.equal(c.get("w"), torch.tensor([1.0, 1, 2, 3, 4, 5]))


@pytest.mark.timeout(120)
def test_second_sigint_forces_exit_while_draining():
    with Daemon("--drain-timeout", "120") as d:
        with Client(d.address, transport="tcp", timeout=120) as c:
            c.put("p", torch.ones(1000))
            sid, _ = c._session()
            spec = tw.TensorSpec("p", (1000,), "float32")
            # a put whose bytes never come: the drain waits for it
            c._ctx.rpc(
                "BeginPut", store_pb2.BeginPutRequest(session_id=sid, spec=spec_to_proto(spec), timeout_ms=100_000)
            )
            d.signal(signal.SIGINT)
            time.sleep(1.5)
            assert d.proc.poll() is None, "the first SIGINT should drain, not exit"
            t0 = time.monotonic()
            d.signal(signal.SIGINT)
            assert d.wait(20) == 130
            assert time.monotonic() - t0 < 10


def _raw_connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


@pytest.mark.timeout(120)
def test_garbage_on_data_and_control_ports_is_dropped_and_daemon_keeps_serving():
    from tensorwire.transport.tcp import HELLO, HELLO_HEAD, HELLO_MAGIC, PROTOCOL_VERSION

    with Daemon() as d:
        data_port = d.info["data"][0]["port"]
        with Client(d.address, transport="tcp") as c:
            c.put("g", torch.arange(1000))
            rng = torch.Generator().manual_seed(0)
            payloads = [
                torch.randint(0, 256, (4096,), generator=rng, dtype=torch.uint8).numpy().tobytes(),  # noise
                HELLO.pack(
                    HELLO_MAGIC, PROTOCOL_VERSION, b"\x00" * 16, b"\x00" * 16
                ),  # a well-formed hello, wrong nonce
                HELLO_HEAD.pack(HELLO_MAGIC, 99, os.urandom(16)),  # wrong version
                HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, os.urandom(16), bytes(16))[:10],  # half a hello
                b"",  # connect and close
            ]
            for p in payloads:
                s = _raw_connect(data_port)
                try:
                    if p:
                        s.sendall(p)
                    s.settimeout(6)
                    try:
                        reply = s.recv(16)
                    except (ConnectionResetError, socket.timeout):
                        reply = b""
                    assert not reply.startswith(b"TWOK"), "a connection without the session nonce was accepted"
                finally:
                    s.close()
            for _ in range(3):  # garbage to the gRPC port
                s = _raw_connect(d.port)
                s.sendall(os.urandom(2048))
                s.close()
            assert torch.equal(c.get("g"), torch.arange(1000))  # the existing session is untouched
        with Client(d.address, transport="tcp") as c2:  # and new ones still work
            assert torch.equal(c2.get_rows("g", [999]), torch.tensor([999]))
        assert "dropped connection" in d.log()


# -- fuzzing the control messages ----------------------------------------------------------------

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.PERMISSION_DENIED,
}

_names = st.one_of(st.sampled_from(["t", "tab", "", "x" * 257, "a\x00b", "ü/ß"]), st.text(max_size=300))
_i64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-2, 70))


def _spec(draw_names=_names):
    return st.builds(
        types_pb2.TensorSpec,
        name=draw_names,
        shape=st.lists(_i64, max_size=10),
        dtype=st.integers(0, 12),
        device=st.integers(0, 3),
        dynamic=st.lists(st.booleans(), max_size=10),
    )


_index = st.one_of(
    st.binary(max_size=4096),
    st.lists(st.integers(-5, 300), max_size=64).map(lambda v: torch.tensor(v, dtype=torch.int64).numpy().tobytes()),
)


@pytest.fixture(scope="module")
def fuzz_target():
    with in_process(max_bytes="64MiB") as s:
        with Client(s.address, transport="tcp") as c:
            c.put("t", torch.ones(4, 4))
            c.put("tab", torch.arange(1200.0).reshape(300, 4))
            sid, _ = c._session()
        ch = grpc.insecure_channel(s.address)
        try:
            yield s, store_pb2_grpc.StoreStub(ch), sid
        finally:
            ch.close()


def _call(fn, req):
    try:
        fn(req, timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()}"


@pytest.mark.timeout(300)
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_fuzzed_control_messages_are_rejected_cleanly(fuzz_target, data):
    srv, stub, _ = fuzz_target
    # Mostly a live session (so validation past the session lookup is reached), sometimes junk.
    live = Client(srv.address, transport="tcp", timeout=5)
    try:
        _fuzz_one(stub, live._session()[0], data)
    finally:
        live.close()


def _fuzz_one(stub, live_sid, data):
    sids = st.one_of(st.just(live_sid), st.just(live_sid), st.sampled_from(["", "0" * 32]), st.text(max_size=40))
    timeouts = st.integers(0, 200)
    method = data.draw(
        st.sampled_from(
            [
                "Declare",
                "BeginPut",
                "PutRows",
                "CommitPut",
                "AbortPut",
                "Get",
                "GetRows",
                "List",
                "Stat",
                "Delete",
                "OpenSession",
                "CloseSession",
            ]
        )
    )
    if method == "Declare":
        _call(stub.Declare, store_pb2.DeclareRequest(session_id=data.draw(sids), spec=data.draw(_spec())))
    elif method == "BeginPut":
        _call(
            stub.BeginPut,
            store_pb2.BeginPutRequest(
                session_id=data.draw(sids), spec=data.draw(_spec()), timeout_ms=data.draw(timeouts)
            ),
        )
    elif method == "PutRows":
        _call(
            stub.PutRows,
            store_pb2.PutRowsRequest(
                session_id=data.draw(sids),
                name=data.draw(_names),
                index=data.draw(_index),
                values=data.draw(_spec()),
                add=data.draw(st.booleans()),
                timeout_ms=data.draw(timeouts),
            ),
        )
    elif method in ("CommitPut", "AbortPut"):
        req = getattr(store_pb2, f"{method}Request")(
            session_id=data.draw(sids), op_id=data.draw(st.integers(0, 2**64 - 1))
        )
        _call(getattr(stub, method), req)
    elif method == "Get":
        _call(
            stub.Get,
            store_pb2.GetRequest(session_id=data.draw(sids), name=data.draw(_names), timeout_ms=data.draw(timeouts)),
        )
    elif method == "GetRows":
        _call(
            stub.GetRows,
            store_pb2.GetRowsRequest(
                session_id=data.draw(sids),
                name=data.draw(_names),
                index=data.draw(_index),
                timeout_ms=data.draw(timeouts),
            ),
        )
    elif method == "List":
        _call(
            stub.List,
            store_pb2.ListRequest(
                page_token=data.draw(st.text(max_size=300)), page_size=data.draw(st.integers(0, 2**32 - 1))
            ),
        )
    elif method == "Stat":
        _call(stub.Stat, store_pb2.StatRequest(name=data.draw(_names)))
    elif method == "Delete":
        name = data.draw(_names.filter(lambda n: n not in ("t", "tab")))
        _call(stub.Delete, store_pb2.DeleteRequest(name=name))
    elif method == "OpenSession":
        req = store_pb2.OpenSessionRequest(
            protocol_version=data.draw(st.integers(0, 5)),
            transport=data.draw(st.sampled_from(["", "tcp", "ucx", "rdma", "auto"])),
            client=data.draw(st.text(max_size=500)),
        )
        try:
            resp = stub.OpenSession(req, timeout=10)
            stub.CloseSession(store_pb2.CloseSessionRequest(session_id=resp.session_id), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() in ALLOWED, f"{exc.code()}: {exc.details()}"
    else:
        _call(stub.CloseSession, store_pb2.CloseSessionRequest(session_id=data.draw(sids)))


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    method=st.sampled_from(["Declare", "BeginPut", "PutRows", "Get", "GetRows", "List", "Stat", "OpenSession"]),
    payload=st.binary(max_size=2048),
)
def test_undecodable_bytes_to_every_method_are_rejected(fuzz_target, method, payload):
    srv, _, _ = fuzz_target
    with grpc.insecure_channel(srv.address) as ch:
        call = ch.unary_unary(f"/tensorwire.v1.Store/{method}")
        try:
            call(payload, timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.UNKNOWN or "Exception" not in (exc.details() or "")


@pytest.mark.timeout(120)
def test_oversized_control_message_is_resource_exhausted_and_server_survives(fuzz_target):
    srv, _, _ = fuzz_target
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(srv.address, options=opts) as ch:
        stub = store_pb2_grpc.StoreStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            stub.GetRows(store_pb2.GetRowsRequest(name="tab", index=b"\x00" * (5 << 20)), timeout=10)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.timeout(120)
def test_server_still_healthy_after_fuzzing(fuzz_target):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv, _, _ = fuzz_target
    with grpc.insecure_channel(srv.address) as ch:
        st_ = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert st_ == health_pb2.HealthCheckResponse.SERVING
    with Client(srv.address, transport="tcp") as c:
        assert torch.equal(c.get("t"), torch.ones(4, 4))
        assert torch.equal(c.get_rows("tab", [299]), torch.arange(1196.0, 1200.0).reshape(1, 4))
        c.put("t", torch.zeros(4, 4))
        assert torch.equal(c.get("t"), torch.zeros(4, 4))
