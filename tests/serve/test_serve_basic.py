"""The store's API and guarantees, against an in-process server on port 0."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client

from serve_common import ALL_DTYPES, SHM, in_process, ucx_usable


@pytest.fixture(scope="module")
def srv():
    with in_process(max_bytes="256MiB", metrics_port=0) as s:
        yield s


@pytest.fixture(params=["tcp", SHM])
def client(srv, request):
    """A client over the TCP data connection, and one whose bytes move through shared memory."""
    with Client(srv.address, transport=request.param, timeout=30) as c:
        assert c.data_path == request.param
        yield c
        for name in c.list():  # the next run (the other transport) starts from an empty store
            c.delete(name)


def _rand(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return (
        torch.randint(-100, 100, shape, generator=g).to(dtype)
        if dtype != torch.uint8
        else torch.randint(0, 255, shape, generator=g).to(dtype)
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_roundtrip_every_dtype(client, dtype):
    name = f"rt/{dtype}"
    for shape in [(3, 5), (), (0, 4), (1,)]:
        client.delete(name) if name in client.list() else None
        x = _rand(shape, dtype, seed=len(shape))
        st = client.put(name, x)
        assert st.version == 1 and st.spec.shape == shape and st.nbytes == x.numel() * x.element_size()
        y = client.get(name)
        assert y.dtype == dtype and tuple(y.shape) == shape and torch.equal(y, x)


@pytest.mark.timeout(60)
def test_tensor_bigger_than_any_grpc_message_moves_over_the_data_plane(client):
    x = torch.randn(4 << 20)  # 16 MiB; gRPC messages are capped at 4 MiB
    client.put("big", x)
    assert torch.equal(client.get("big"), x)
    client.delete("big")


@pytest.mark.timeout(60)
def test_versions_shape_mismatch_names_both_and_changes_nothing(client):
    a = torch.arange(12.0).reshape(3, 4)
    assert client.put("m", a).version == 1
    assert client.put("m", a * 2).version == 2
    with pytest.raises(tw.ShapeMismatchError) as ei:
        client.put("m", torch.zeros(4, 3))
    msg = str(ei.value)
    assert "float32[3, 4]" in msg and "float32[4, 3]" in msg and "m" in msg
    with pytest.raises(tw.ShapeMismatchError, match="int64"):
        client.put("m", torch.zeros(3, 4, dtype=torch.int64))
    st = client.stat("m")
    assert st.version == 2 and torch.equal(client.get("m"), a * 2)


@pytest.mark.timeout(60)
def test_get_out_and_noncontiguous_and_missing(client):
    x = torch.randn(8, 6)
    client.put("o", x.t())  # non-contiguous source
    out = torch.empty(6, 8)
    assert client.get("o", out=out) is out and torch.equal(out, x.t())
    nc = torch.empty(8, 6).t()  # non-contiguous destination
    assert torch.equal(client.get("o", out=nc), x.t())
    with pytest.raises(tw.ShapeMismatchError, match="out="):
        client.get("o", out=torch.empty(6, 9))
    assert torch.equal(client.get("o"), x.t())  # the session is still in step
    with pytest.raises(tw.NotFoundError):
        client.get("nope")
    with pytest.raises(tw.NotFoundError):
        client.stat("nope")
    with pytest.raises(tw.NotFoundError):
        client.delete("nope")


@pytest.mark.timeout(60)
def test_declared_but_unwritten_is_listed_not_readable(client):
    st = client.declare(tw.TensorSpec("decl", (4, 4), "float16"))
    assert st.version == 0
    assert client.list()["decl"].dtype == "float16"
    with pytest.raises(tw.NotFoundError, match="no data yet"):
        client.get("decl")
    client.put("decl", torch.ones(4, 4, dtype=torch.float16))
    assert client.stat("decl").version == 1


@pytest.mark.timeout(60)
def test_rows_get_put_add(client):
    tab = torch.randn(1000, 8)
    client.put("tab", tab)
    idx = torch.tensor([5, 0, 999, 5, 17])
    assert torch.equal(client.get_rows("tab", idx), tab[idx])
    assert torch.equal(client.get_rows("tab", [3]), tab[[3]])
    assert client.get_rows("tab", []).shape == (0, 8)
    out = torch.empty(5, 8)
    assert client.get_rows("tab", idx, out=out) is out and torch.equal(out, tab[idx])
    v0 = client.stat("tab").version
    vals = torch.randn(3, 8)
    client.put_rows("tab", [1, 2, 3], vals)
    tab[[1, 2, 3]] = vals
    upd = torch.ones(4, 8)
    st = client.add_rows("tab", [7, 7, 8, 9], upd)  # duplicates accumulate
    tab.index_add_(0, torch.tensor([7, 7, 8, 9]), upd)
    assert st.version == v0 + 2
    assert torch.equal(client.get("tab"), tab)
    # invalid requests change nothing
    with pytest.raises(tw.SpecError, match="out of range"):
        client.get_rows("tab", [1000])
    with pytest.raises(tw.SpecError, match="out of range"):
        client.add_rows("tab", [-1], torch.ones(1, 8))
    with pytest.raises(tw.SpecError, match="duplicate"):
        client.put_rows("tab", [4, 4], torch.ones(2, 8))
    with pytest.raises(tw.ShapeMismatchError):
        client.put_rows("tab", [4], torch.ones(1, 9))
    with pytest.raises(tw.ShapeMismatchError):
        client.add_rows("tab", [4], torch.ones(1, 8, dtype=torch.float64))
    with pytest.raises(tw.SpecError):
        client.get_rows("tab", [[1, 2]])
    assert client.stat("tab").version == v0 + 2 and torch.equal(client.get("tab"), tab)


@pytest.mark.timeout(60)
def test_max_bytes_exceeded_is_clear_and_changes_nothing():
    with in_process(max_bytes="1MiB") as s, Client(s.address, transport="tcp") as c:
        c.put("a", torch.zeros(64 << 10, dtype=torch.uint8))  # 64 KiB, reserves 128 KiB
        before = {k: v for k, v in c.stats().items()}
        reserved = s.service.store.reserved
        with pytest.raises(tw.ResourceExhaustedError, match="max-bytes"):
            c.put("b", torch.zeros(1 << 20, dtype=torch.uint8))
        with pytest.raises(tw.ResourceExhaustedError):
            c.declare(tw.TensorSpec("c", (10 << 20,), "uint8"))
        assert c.stats() == before and s.service.store.reserved == reserved
        assert torch.equal(c.get("a"), torch.zeros(64 << 10, dtype=torch.uint8))
        c.put("b", torch.ones(100, dtype=torch.uint8))  # what fits still goes in


@pytest.mark.timeout(60)
def test_repeated_gets_reuse_buffers_and_never_overwrite_a_held_result(client):
    client.put("reuse", torch.zeros(256))
    x = client.get("reuse")
    x = client.get("reuse")  # two buffers: one held by the caller, one being filled
    pool = client._ctx.pools[("reuse", "get")]
    n = pool.allocations
    for _ in range(50):
        x = client.get("reuse")  # noqa: F841 - held across the next call, as in a loop
    assert pool.allocations == n, "steady-state gets allocated"
    held = client.get("reuse")
    client.put("reuse", torch.ones(256))
    again = client.get("reuse")
    assert torch.equal(held, torch.zeros(256)), "a tensor the caller holds was overwritten"
    assert torch.equal(again, torch.ones(256))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["tcp", SHM])
def test_get_concurrent_with_puts_sees_old_or_new_whole(srv, kind):
    n = 1 << 16
    with Client(srv.address, transport=kind) as w, Client(srv.address, transport=kind) as r:
        w.put("cons", torch.zeros(n, dtype=torch.int64))
        stop = threading.Event()
        seen = set()

        def writer():
            v = 0
            while not stop.is_set():
                v += 1
                w.put("cons", torch.full((n,), v, dtype=torch.int64))

        th = threading.Thread(target=writer)
        th.start()
        try:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                t = r.get("cons")
                first = int(t[0])
                assert bool((t == first).all()), "torn read"
                seen.add(first)
        finally:
            stop.set()
            th.join(30)
        assert len(seen) > 1


@pytest.mark.timeout(60)
def test_health_and_metrics(srv, client):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(srv.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="tensorwire.v1.Store"), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    client.put("metric", torch.ones(1000))
    client.get("metric")
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    for name in (
        "tensorwire_bytes_total",
        "tensorwire_operations_total",
        "tensorwire_operation_seconds_bucket",
        "tensorwire_memory_bytes",
        "tensorwire_slots",
        "tensorwire_errors_total",
        "tensorwire_sessions",
        "tensorwire_transfer_seconds_bucket",
        "tensorwire_reserved_bytes",
    ):
        assert name in body, name
    assert f'tensorwire_bytes_total{{direction="in",transport="{client.data_path}"}}' in body
    assert 'tensorwire_operations_total{op="Get",status="ok"}' in body


@pytest.mark.timeout(60)
def test_draining_server_is_not_serving_and_refuses_new_work():
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with in_process() as s, Client(s.address, transport="tcp") as c:
        c.put("d", torch.ones(3))
        s.drain()
        with grpc.insecure_channel(s.address) as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert st == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(tw.PeerLostError, match="shutting down"):
            c.put("d", torch.ones(3))
        assert c.stat("d").version == 1  # reads of metadata still answer


@pytest.mark.timeout(60)
def test_snapshot_rpc_writes_safetensors_and_a_new_server_restores_it(tmp_path):
    from safetensors.torch import load_file

    x = torch.randn(10, 3)
    b = torch.tensor([True, False, True])
    with in_process(snapshot_dir=str(tmp_path)) as s, Client(s.address, transport="tcp") as c:
        c.put("x", x)
        c.put("x", x * 3)
        c.put("flags", b)
        c.declare(tw.TensorSpec("empty-decl", (2,), "int32"))  # never written: not in the snapshot
        info = c.snapshot()
        assert info.tensors == 2 and info.path.endswith("store.safetensors")
    loaded = load_file(str(tmp_path / "store.safetensors"))  # the safetensors library reads it
    assert torch.equal(loaded["x"], x * 3) and torch.equal(loaded["flags"], b) and set(loaded) == {"x", "flags"}
    with in_process(snapshot_dir=str(tmp_path)) as s2, Client(s2.address, transport="tcp") as c:
        assert s2.restored == 2
        assert torch.equal(c.get("x"), x * 3) and c.stat("x").version == 2
        assert torch.equal(c.get("flags"), b)


@pytest.mark.timeout(60)
def test_snapshot_without_dir_is_a_config_error(client):
    with pytest.raises(tw.ConfigError, match="snapshot-dir"):
        client.snapshot()


@pytest.mark.timeout(60)
def test_client_recovers_when_the_server_drops_its_session(srv):
    with Client(srv.address, transport="tcp") as c:
        c.put("rec", torch.ones(5))
        srv.service.close_all("test")
        assert torch.equal(c.get("rec"), torch.ones(5))  # a fresh session, transparently
        c.close()
        with pytest.raises(tw.ClosedError):
            c.get("rec")


@pytest.mark.timeout(60)
def test_bad_client_arguments():
    with pytest.raises(tw.ConfigError):
        Client("127.0.0.1:1", transport="rdma")
    with pytest.raises(tw.ConfigError):
        Client("host:notaport")
    with pytest.raises(tw.PeerLostError):
        Client("127.0.0.1:1", transport="tcp", connect_timeout=2)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_usable(), reason="ucxx not importable")
def test_auto_transport_uses_ucx_when_it_works():
    with in_process(transport="auto") as s:
        kinds = {d["kind"] for d in s.ready_info()["data"]}
        if "ucx" not in kinds:
            pytest.skip("UCX did not pass the server's self-test here")
        assert kinds == {"ucx", "tcp"}
        with Client(s.address, transport="auto") as c:
            assert c.transport_kind == "ucx"  # same host and IPC namespace: UCX (shared memory / cma)
            x = torch.randn(300, 40)
            c.put("u", x)
            assert torch.equal(c.get("u"), x)
            assert torch.equal(c.get_rows("u", [1, 299]), x[[1, 299]])
            c.add_rows("u", [0], torch.ones(1, 40))
            x[0] += 1
            assert torch.equal(c.get("u"), x)
        with Client(s.address, transport="tcp") as c:  # the TCP fallback listener serves too
            assert c.transport_kind == "tcp" and torch.equal(c.get("u"), x)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not ucx_usable(), reason="ucxx not importable")
def test_auto_prefer_tcp_keeps_same_host_clients_on_tcp(monkeypatch):
    with in_process(transport="auto") as s:
        if "ucx" not in {d["kind"] for d in s.ready_info()["data"]}:
            pytest.skip("UCX did not pass the server's self-test here")
        monkeypatch.setenv("TENSORWIRE_AUTO_PREFER", "tcp")
        with Client(s.address, transport="auto") as c:
            c.put("v", torch.ones(4))
            assert c.transport_kind == "tcp"


@pytest.mark.timeout(60)
def test_tcp_only_server_with_auto_client_warns_and_uses_tcp(srv, caplog):
    import logging

    import tensorwire.serve.client.context as cl

    cl._warned.clear()
    with caplog.at_level(logging.WARNING, logger="tensorwire.serve.client"):
        with Client(srv.address, transport="auto") as c:
            assert c.transport_kind == "tcp"
    assert any("using TCP" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(60)
def test_port_in_use_is_a_clear_config_error(srv):
    from tensorwire.serve import ServeConfig, Server

    with pytest.raises(tw.ConfigError, match="in use"):
        Server(ServeConfig(port=srv.port, transport="tcp")).start()
