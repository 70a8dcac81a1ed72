"""Posted reads (``wire.FLAG_POSTED``): over TCP a client that has seen a tensor's spec posts the payload's receive
before its get / get_rows request. The daemon sends the payload into it when the spec is the one expected, and
otherwise (another spec, an error) completes it with an empty message first; either way the result is the stored
tensor and the session stays in step."""

from __future__ import annotations

import struct

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client.client import Client
from tensorwire.serve.client.request_calls import RequestCalls
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.common import DATA_REQUESTS_LEVEL, POSTED_READS

from serve_common import in_process

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="tcp", max_bytes="256MiB") as s:
        yield s


@pytest.fixture
def posted(monkeypatch):
    """What each posted read came to: True, the payload landed in the posted receive; False, it was completed empty
    and the payload came as the reply said; the class name of the error it raised."""
    seen: list = []
    real = RequestCalls.call_posted

    def counting(self, *args, **kwargs):
        try:
            rep, landed = real(self, *args, **kwargs)
        except tw.TensorWireError as exc:
            seen.append(type(exc).__name__)
            raise
        seen.append(landed)
        return rep, landed

    monkeypatch.setattr(RequestCalls, "call_posted", counting)
    return seen


def _client(srv) -> Client:
    return Client(srv.address, transport="tcp")


def test_reads_of_a_known_spec_land_in_the_posted_receive(srv, posted):
    tab = torch.randn(5000, 32)
    idx = torch.randint(0, 5000, (700,), generator=torch.Generator().manual_seed(3))
    with _client(srv) as c:
        c.put("land", tab)  # the put's reply gives the client the spec
        assert c._dp and c._requests is not None and c._requests.posting
        out = torch.empty(5000, 32)
        assert c.get("land", out=out) is out and torch.equal(out, tab)
        assert torch.equal(c.get("land"), tab)
        rows = torch.empty(700, 32)
        assert c.get_rows("land", idx, out=rows) is rows and torch.equal(rows, tab[idx])
        assert torch.equal(c.get_rows("land", idx), tab[idx])
        strided = torch.empty(32, 700).t()  # the right shape, not contiguous: received beside it, then copied
        assert c.get_rows("land", idx, out=strided) is strided and torch.equal(strided, tab[idx])
        assert posted == [True] * 5
        sid = c._sid
        assert torch.equal(c.get_rows("land", []), tab[:0])  # no bytes: not posted
        assert posted == [True] * 5 and c._sid == sid


def _replace(c: Client, name: str, t: torch.Tensor) -> None:
    """A new spec under ``name`` (a put keeps the spec: delete first)."""
    c.delete(name)
    c.put(name, t)


def test_another_spec_completes_the_receive_empty_and_the_read_goes_on(srv, posted):
    first = torch.randn(100, 8)
    with _client(srv) as a, _client(srv) as b:
        a.put("swap", first)
        sid = a._sid
        for new in (
            torch.arange(800, dtype=torch.int32).reshape(100, 8),  # the same bytes, another dtype
            torch.randn(100, 4),  # other rows
            torch.randn(30, 8, dtype=torch.float64),
        ):
            _replace(b, "swap", new)
            del posted[:]
            assert torch.equal(a.get("swap"), new)  # expected the previous spec: completed empty, then sent
            assert posted == [False]
            assert torch.equal(a.get("swap"), new)  # the spec is known now
            assert torch.equal(a.get_rows("swap", [29, 0, 3]), new[[29, 0, 3]])
            assert posted == [False, True, True]
        _replace(b, "swap", first)  # the client expects float64[30, 8]: it posts into out=, which must stay untouched
        keep = torch.full((30, 8), 7.0, dtype=torch.float64)
        with pytest.raises(tw.ShapeMismatchError):
            a.get("swap", out=keep)
        assert posted[-1] is False and torch.equal(keep, torch.full((30, 8), 7.0, dtype=torch.float64))
        _replace(b, "swap", torch.randn(100, 8, dtype=torch.float64))  # the client expects float32[100, 8] now
        rows = torch.full((2, 8), 7.0)
        with pytest.raises(tw.ShapeMismatchError):
            a.get_rows("swap", [1, 2], out=rows)
        assert posted[-1] is False and torch.equal(rows, torch.full((2, 8), 7.0))
        bigger = torch.randn(300, 8, dtype=torch.float64)  # more rows of the same shape: the rows asked for fit
        _replace(b, "swap", bigger)
        del posted[:]
        assert torch.equal(a.get_rows("swap", [299, 5]), bigger[[299, 5]])
        assert posted == [True]
        assert a._sid == sid, "a read of another spec must not cost the session"


def test_errors_complete_the_posted_receive_and_keep_the_session(srv, posted):
    tab = torch.arange(40.0).reshape(10, 4)
    with _client(srv) as a, _client(srv) as b:
        a.put("gone", tab)
        sid = a._sid
        with pytest.raises(tw.SpecError, match="out of range"):
            a.get_rows("gone", [10])
        b.delete("gone")
        with pytest.raises(tw.NotFoundError):
            a.get("gone")
        with pytest.raises(tw.NotFoundError):
            a.get_rows("gone", [1])
        assert posted == ["SpecError", "NotFoundError", "NotFoundError"]
        b.put("gone", tab * 2)
        assert torch.equal(a.get("gone"), tab * 2) and torch.equal(a.get_rows("gone", [9, 0]), tab[[9, 0]] * 2)
        assert posted[3:] == [True, True]
        assert a._sid == sid


def test_concurrent_puts_never_tear_a_posted_read(srv, posted):
    import threading

    n = 4096
    with _client(srv) as reader, _client(srv) as writer:
        writer.put("whole", torch.zeros(n, 16))
        reader.get("whole")
        stop = threading.Event()

        def write() -> None:
            v = 1.0
            while not stop.is_set():
                writer.put("whole", torch.full((n, 16), v))
                v += 1.0

        th = threading.Thread(target=write, daemon=True)
        th.start()
        try:
            idx = torch.arange(0, n, 7)
            for _ in range(100):
                whole = reader.get("whole")
                assert bool((whole == whole[0, 0]).all()), "a get mixed two versions"
                rows = reader.get_rows("whole", idx)
                assert bool((rows == rows[0, 0]).all()), "a get_rows mixed two versions"
        finally:
            stop.set()
            th.join(30)
        assert posted and all(posted)


def test_a_daemon_without_posted_reads_gets_the_reply_first_order(posted):
    with in_process(transport="tcp") as s:
        s.service.data_requests = POSTED_READS - 1  # what a daemon from before posted reads answers
        with Client(s.address, transport="tcp") as c:
            x = torch.randn(64, 8)
            c.put("old", x)
            assert c._dp and not c._requests.posting
            assert torch.equal(c.get("old"), x) and torch.equal(c.get_rows("old", [63, 1]), x[[63, 1]])
        s.service.data_requests = DATA_REQUESTS_LEVEL
        with Client(s.address, transport="tcp") as c:
            assert torch.equal(c.get("old"), x) and c._requests.posting  # (the spec is unknown: not posted)
            assert torch.equal(c.get("old"), x)
        assert posted == [True]


F32 = wire.dtype_code("float32")


def _posted_request(op, *, dtype=F32, shape=(3, 2), index=(0, 1, 2), flags=wire.FLAG_POSTED):
    name = b"t"
    buf = bytearray(wire.request_size(len(name), len(index)))
    off = wire.pack_request(
        memoryview(buf), op=op, req_id=1, name=name, dtype=dtype, shape=shape, nindex=len(index), flags=flags
    )
    buf[off:] = struct.pack(f"<{len(index)}q", *index)
    return memoryview(bytes(buf))


def test_the_format_of_a_posted_read():
    req = wire.parse_request(_posted_request(wire.OP_GET_ROWS))
    assert req.posted and req.shape == (3, 2) and req.dtype == wire.dtype_code("float32") and req.nindex == 3
    req = wire.parse_request(_posted_request(wire.OP_GET, shape=(5,), index=()))
    assert req.posted and req.shape == (5,)
    assert wire.parse_request(_posted_request(wire.OP_GET, shape=(), index=())).shape == ()  # a 0-d tensor
    assert not wire.parse_request(_posted_request(wire.OP_GET, dtype=0, shape=(), index=(), flags=0)).posted
    for why, raw in {
        "a put": _posted_request(wire.OP_PUT, index=()),
        "shared memory": _posted_request(wire.OP_GET, index=(), flags=wire.FLAG_POSTED | wire.FLAG_SHM),
        "rows other than the index": _posted_request(wire.OP_GET_ROWS, shape=(4, 2)),
        "no rank": _posted_request(wire.OP_GET_ROWS, shape=()),
        "negative dims": _posted_request(wire.OP_GET, shape=(-1,), index=()),
        "no dtype": _posted_request(wire.OP_GET, dtype=0, shape=(5,), index=()),
    }.items():
        with pytest.raises(wire.MalformedRequest):
            wire.parse_request(raw)
        assert why
