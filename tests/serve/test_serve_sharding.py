"""One client over three ``tensorwire serve`` daemons: placement, tables sharded by rows, the layout check,
a daemon's loss and its return from its snapshot. Every daemon runs with a token, TLS and ``--max-bytes``."""

from __future__ import annotations

import signal
import socket
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.client import sharding
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.layout import LAYOUT_BYTES, ShardLayout, fingerprint, row_ranges
from tensorwire.serve.client.sharded_client import ShardedClient, ShardedStat

from serve_common import Daemon, make_pki

TOKEN = "sharded-token-0123456789abcdef"
TIMEOUT = 5.0  # the clients' per-operation timeout: a lost daemon must be reported within it
MAX_BYTES = ["600MiB", "600MiB", "400MiB"]  # the third is smaller: a table can fit two daemons and not it


# -- pure functions -----------------------------------------------------------------------------------
def test_row_ranges_are_contiguous_balanced_and_cover_every_row():
    for rows, n in [(0, 3), (1, 3), (2, 3), (10, 3), (1_000_000, 3), (7, 7), (5, 1)]:
        r = row_ranges(rows, n)
        assert r[0][0] == 0 and r[-1][1] == rows and all(r[i][1] == r[i + 1][0] for i in range(n - 1))
        sizes = [b - a for a, b in r]
        assert max(sizes) - min(sizes) <= 1


def test_rendezvous_placement_moves_about_one_nth_of_the_names_when_a_daemon_joins():
    three = ["a:1", "b:1", "c:1"]
    four = three + ["d:1"]
    names = [f"t{i}" for i in range(3000)]
    before = [three[sharding.owner(n, three)] for n in names]
    after = [four[sharding.owner(n, four)] for n in names]
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    assert all(y == "d:1" for _, y in moved)  # only to the new daemon, never between old ones
    assert 0.18 < len(moved) / len(names) < 0.32  # ~1/4
    assert before == [three[sharding.owner(n, list(three))] for n in names]  # a pure function of the list


def test_row_split_parts_and_gather_restore_the_callers_order():
    rows, n = 1000, 3
    idx = torch.tensor([999, 0, 500, 333, 334, 666, 667, 0, 998])
    table = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
    split = sharding.RowSplit(idx, rows, n)
    ranges = row_ranges(rows, n)
    sorted_rows = torch.empty(idx.numel(), 2)
    for k, local, a, b in split.parts:
        assert int(local.min()) >= 0 and int(local.max()) < ranges[k][1] - ranges[k][0]
        sorted_rows[a:b] = table[local + ranges[k][0]]
    assert torch.equal(split.gather(sorted_rows, torch.empty(idx.numel(), 2)), table[idx])
    one = sharding.RowSplit(torch.tensor([1, 5, 2]), rows, n)
    assert one.order is None and len(one.parts) == 1
    with pytest.raises(tw.SpecError):
        sharding.RowSplit(torch.tensor([rows]), rows, n)


def test_dns_address_resolves_every_address_ordered_by_reverse_name(monkeypatch):
    ips = ["10.0.0.7", "10.0.0.3", "10.0.0.12"]
    names = {
        "10.0.0.7": "tw-2.tw.ns.svc.cluster.local.",
        "10.0.0.3": "tw-10.tw.ns.svc.cluster.local",
        "10.0.0.12": "tw-0.tw.ns.svc.cluster.local",
    }
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, port, **kw: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ips + ips],
    )
    monkeypatch.setattr(socket, "getnameinfo", lambda sa, flags: (names[sa[0]], str(sa[1])))
    assert sharding.resolve_daemons("dns:///tw.ns.svc:7100") == [
        "tw-0.tw.ns.svc.cluster.local:7100",
        "tw-2.tw.ns.svc.cluster.local:7100",
        "tw-10.tw.ns.svc.cluster.local:7100",
    ]
    assert sharding.resolve_daemons("dns:///tw.ns.svc:7100", reverse=False) == [
        "10.0.0.3:7100",
        "10.0.0.7:7100",
        "10.0.0.12:7100",
    ]

    def no_ptr(sa, flags):
        raise socket.gaierror("no PTR")

    monkeypatch.setattr(socket, "getnameinfo", no_ptr)
    assert sharding.resolve_daemons("dns:///tw.ns.svc:7100")[0] == "10.0.0.3:7100"
    with pytest.raises(tw.ConfigError):
        sharding.resolve_daemons(["a:1", "a:1"])


def test_layout_travels_in_data_plane_requests_and_bad_ones_are_malformed():
    la = ShardLayout.of(fingerprint(["a:1", "b:1"]), 2, 1, 11)
    assert (la.row_start, la.row_stop) == (5, 11) and ShardLayout.unpack(la.pack()) == la
    assert ShardLayout.from_json(la.to_json()) == la and ShardLayout.from_proto(la.to_proto()) == la
    buf = bytearray(wire.request_size(3, 2, layout=True))
    off = wire.pack_request(
        memoryview(buf), op=wire.OP_GET_ROWS, req_id=1, name=b"emb", nindex=2, flags=wire.FLAG_LAYOUT, layout=la.pack()
    )
    assert off == wire.REQUEST.size + 8 + LAYOUT_BYTES
    req = wire.parse_request(memoryview(bytes(buf)))
    assert req.layout == la and req.index_offset == off and req.name == "emb"
    plain = bytearray(wire.request_size(3, 0))
    wire.pack_request(memoryview(plain), op=wire.OP_GET, req_id=1, name=b"emb")
    assert wire.parse_request(memoryview(bytes(plain))).layout is None
    bad = bytearray(buf)
    bad[wire.REQUEST.size + 8 + 16 : wire.REQUEST.size + 8 + 20] = (5).to_bytes(4, "little")  # index 5 of 2 shards
    with pytest.raises(wire.MalformedRequest):
        wire.parse_request(memoryview(bytes(bad)))


# -- three daemons on loopback ----------------------------------------------------------------------------
class Cluster:
    def __init__(self, tmp, pki):
        self.tmp = tmp
        self.token = tmp / "token"
        self.token.write_text(TOKEN + "\n")
        self.token.chmod(0o600)
        self.pki = pki
        self.daemons: list[Daemon] = []
        for i in range(3):
            self.daemons.append(self.start(i))

    def start(self, i: int, port: int = 0) -> Daemon:
        snap = self.tmp / f"snap{i}"
        snap.mkdir(exist_ok=True)
        return Daemon(
            "--token-file",
            str(self.token),
            "--tls-cert",
            self.pki["server.pem"],
            "--tls-key",
            self.pki["server.key"],
            "--max-bytes",
            MAX_BYTES[i],
            "--snapshot-dir",
            str(snap),
            transport="tcp",
            port=port,
        )

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.daemons]

    def client(self, addresses=None, **kw) -> ShardedClient:
        kw.setdefault("timeout", TIMEOUT)
        kw.setdefault("connect_timeout", TIMEOUT)
        return tw.Client(addresses or self.addresses, token=TOKEN, tls={"ca": self.pki["ca1.pem"]}, **kw)

    def plain(self, i: int, **kw) -> Client:
        return Client(self.daemons[i].address, token=TOKEN, tls={"ca": self.pki["ca1.pem"]}, timeout=TIMEOUT, **kw)

    def close(self) -> None:
        for d in self.daemons:
            d.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded")
    pki_dir = tmp / "pki"
    pki_dir.mkdir()
    c = Cluster(tmp, make_pki(pki_dir))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def client(cluster):
    with cluster.client() as c:
        yield c


@pytest.mark.timeout(120)
def test_a_million_row_table_sharded_over_three_daemons(cluster, client):
    assert isinstance(client, ShardedClient) and client.addresses == cluster.addresses
    rows, dim = 1_000_000, 64
    g = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=g)
    st = client.put("emb", table, shard="rows")
    assert isinstance(st, ShardedStat) and st.spec.shape == (rows, dim) and len(st.shards) == 3
    assert [(s.layout.row_start, s.layout.row_stop) for s in st.shards] == row_ranges(rows, 3)
    # every daemon holds exactly its range, as a shard with its layout
    for i in range(3):
        with cluster.plain(i) as p:
            held = p.stat("emb")
            a, b = row_ranges(rows, 3)[i]
            assert held.spec.shape == (b - a, dim) and held.layout.index == i and held.layout.rows == rows
            assert held.layout.fingerprint == client.fingerprint

    idx = torch.randint(0, rows, (4096,), generator=g)
    assert torch.equal(client.get_rows("emb", idx), table[idx])
    out = torch.empty(4096, dim)
    assert client.get_rows("emb", idx, out=out) is out and torch.equal(out, table[idx])
    assert torch.equal(client.get_rows("emb", [rows - 1, 0, 333_333]), table[[rows - 1, 0, 333_333]])
    assert client.get_rows("emb", []).shape == (0, dim)
    with pytest.raises(tw.SpecError):
        client.get_rows("emb", [rows])

    dup = torch.cat([idx[:2048], idx[:1024], torch.tensor([5, 5, 5, rows - 1])])  # duplicates, across every shard
    vals = torch.randn(dup.numel(), dim, generator=g)
    client.add_rows("emb", dup, vals)
    table.index_add_(0, dup, vals)
    assert torch.allclose(client.get_rows("emb", dup), table[dup], atol=1e-5)

    uniq = torch.randperm(rows, generator=g)[:3000]
    new = torch.randn(3000, dim, generator=g)
    client.put_rows("emb", uniq, new)
    table[uniq] = new
    with pytest.raises(tw.SpecError):  # duplicates in put_rows are ambiguous, as on one daemon
        client.put_rows("emb", [7, 7], torch.zeros(2, dim))

    got = client.get("emb")
    assert got.shape == (rows, dim) and torch.allclose(got, table, atol=1e-5)
    assert client.list()["emb"].shape == (rows, dim)
    assert client.stat("emb").version == sum(s.stat.version for s in client.stat("emb").shards)
    client.delete("emb")
    assert "emb" not in client.list()
    for i in range(3):
        with cluster.plain(i) as p:
            assert "emb" not in p.list()


@pytest.mark.timeout(120)
def test_300_names_spread_over_the_daemons(cluster, client):
    names = [f"w{i}" for i in range(300)]
    for n in names:
        client.put(n, torch.full((4,), float(len(n))))
    counts = []
    for i in range(3):
        with cluster.plain(i) as p:
            held = {n for n in p.list() if n.startswith("w")}
            counts.append(len(held))
            assert all(client.owner(n) == cluster.addresses[i] for n in held)
    assert sum(counts) == 300 and all(0.20 * 300 <= c <= 0.47 * 300 for c in counts), counts
    assert torch.equal(client.get("w7"), torch.full((4,), 2.0))
    assert set(names) <= set(client.list())
    for n in names:
        client.delete(n)
    assert not any(n.startswith("w") for n in client.list())


@pytest.mark.timeout(120)
def test_another_order_or_one_daemon_fewer_is_refused_and_touches_nothing(cluster, client):
    t = torch.arange(3000 * 8, dtype=torch.float32).view(3000, 8)
    client.put("tab", t, shard="rows")
    before = client.stat("tab")
    for addrs in (
        cluster.addresses[::-1],
        cluster.addresses[:2],
        [cluster.addresses[1], cluster.addresses[0], cluster.addresses[2]],
    ):
        with cluster.client(addrs) as other:
            for op in (
                lambda: other.get_rows("tab", [0, 1500, 2999]),
                lambda: other.get("tab"),
                lambda: other.add_rows("tab", [0, 2999], torch.ones(2, 8)),
                lambda: other.put_rows("tab", [10], torch.ones(1, 8)),
                lambda: other.put("tab", t, shard="rows"),
                lambda: other.delete("tab"),
            ):
                with pytest.raises(tw.LayoutMismatchError, match="daemon list differs"):
                    op()
    # the daemons refuse on their own, on both request paths, when a client skips its own check
    wrong = ShardLayout.of(fingerprint(cluster.addresses[::-1]), 3, 0, 3000)
    for data_requests in (True, False):
        with cluster.plain(0, data_requests=data_requests) as p:
            with pytest.raises(tw.LayoutMismatchError, match="whole tensor was refused"):
                p.get_rows("tab", [0])  # a client over no list: a shard is not a whole tensor
            p.expect_layout("tab", wrong)
            for op in (
                lambda: p.get_rows("tab", [0]),
                lambda: p.get("tab"),
                lambda: p.add_rows("tab", [0], torch.ones(1, 8)),
                lambda: p.put("tab", t[:1000]),
                lambda: p.delete("tab"),
            ):
                with pytest.raises(tw.LayoutMismatchError):
                    op()
    after = client.stat("tab")
    assert [s.stat.version for s in after.shards] == [s.stat.version for s in before.shards]
    assert torch.equal(client.get("tab"), t)
    client.delete("tab")


@pytest.mark.timeout(120)
def test_max_bytes_per_daemon_a_table_one_daemon_cannot_hold_leaves_nothing_behind(cluster, client):
    # 2.7M x 64 float32: 900,000 rows = 230 MB per shard, 461 MB double-buffered: fits 600 MiB, not 400 MiB
    spec = tw.TensorSpec("big", (2_700_000, 64), "float32")
    with pytest.raises(tw.ResourceExhaustedError):
        client.declare(spec, shard="rows")
    for i in range(3):
        with cluster.plain(i) as p:
            assert "big" not in p.list()
    small = torch.randn(30_000, 64)
    client.put("fits", small, shard="rows")
    assert torch.equal(client.get("fits"), small)
    client.delete("fits")


@pytest.mark.timeout(120)
def test_a_sharded_client_needs_the_token_on_every_daemon(cluster):
    with pytest.raises(tw.AuthError):
        tw.Client(cluster.addresses, token="wrong", tls={"ca": cluster.pki["ca1.pem"]}, timeout=TIMEOUT)
    with pytest.raises(tw.AuthError):
        tw.Client(cluster.addresses, token=TOKEN, timeout=TIMEOUT)  # no TLS to TLS daemons


@pytest.mark.timeout(150)
def test_a_killed_daemon_is_contained_and_the_same_client_recovers_from_its_snapshot(cluster, client):
    rows = 90_000
    t = torch.randn(rows, 16)
    client.put("kt", t, shard="rows")
    victim = 1
    whole = next(n for n in (f"k{i}" for i in range(100)) if client.owner(n) != cluster.addresses[victim])
    client.put(whole, torch.arange(5.0))
    on_victim = next(n for n in (f"v{i}" for i in range(100)) if client.owner(n) == cluster.addresses[victim])
    client.put(on_victim, torch.arange(3.0))
    client.snapshot()
    lost_update = torch.tensor([row_ranges(rows, 3)[victim][0]])  # after the snapshot, on the victim's shard
    client.add_rows("kt", lost_update, torch.ones(1, 16))

    d = cluster.daemons[victim]
    port = d.port
    d.signal(signal.SIGKILL)
    d.wait(10)
    a, b = row_ranges(rows, 3)[victim]
    mine = torch.tensor([0, 10, rows - 1])  # rows of the other two shards
    assert torch.equal(client.get_rows("kt", mine), t[mine])
    assert torch.equal(client.get(whole), torch.arange(5.0))
    for op in (
        lambda: client.get_rows("kt", [0, a + 5]),
        lambda: client.get("kt"),
        lambda: client.add_rows("kt", [a], torch.ones(1, 16)),
        lambda: client.get(on_victim),
    ):
        t0 = time.monotonic()
        with pytest.raises(tw.PeerLostError) as ei:
            op()
        assert time.monotonic() - t0 < TIMEOUT + 1  # the client's timeout (plus scheduling)
        assert isinstance(ei.value, tw.ShardLostError) and ei.value.address == cluster.addresses[victim]
        assert cluster.addresses[victim] in str(ei.value)
    assert torch.equal(client.get_rows("kt", mine), t[mine])  # the others still work

    d.close()
    cluster.daemons[victim] = cluster.start(victim, port=port)  # same port, same snapshot directory
    deadline = time.monotonic() + 20
    while True:
        try:
            got = client.get("kt")
            break
        except tw.ShardLostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert torch.equal(got, t)  # as of the snapshot: the add_rows after it is lost, nothing else
    assert torch.equal(client.get_rows("kt", [a, b - 1, 0]), t[[a, b - 1, 0]])
    assert torch.equal(client.get(on_victim), torch.arange(3.0))
    with cluster.plain(victim) as p:
        assert p.stat("kt").layout == ShardLayout.of(client.fingerprint, 3, victim, rows)  # restored with it
    for n in ("kt", whole, on_victim):
        client.delete(n)


@pytest.mark.timeout(60)
def test_one_element_list_is_the_plain_client_and_dns_names_one_daemon(cluster):
    with tw.Client([cluster.addresses[0]], token=TOKEN, tls={"ca": cluster.pki["ca1.pem"]}, timeout=TIMEOUT) as c:
        assert type(c) is Client
        c.put("solo", torch.ones(3))
        assert c.stat("solo").layout is None
        c.delete("solo")
    port = cluster.daemons[0].port
    with tw.Client(
        f"dns:///127.0.0.1:{port}", token=TOKEN, tls={"ca": cluster.pki["ca1.pem"]}, timeout=TIMEOUT, reverse_dns=False
    ) as c:
        assert isinstance(c, ShardedClient) and c.addresses == [cluster.addresses[0]]
        x = torch.randn(100, 4)
        c.put("dnst", x, shard="rows")
        assert torch.equal(c.get_rows("dnst", [99, 0]), x[[99, 0]])
        c.delete("dnst")
