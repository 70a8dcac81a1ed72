"""``TENSORWIRE_SERVE_ROWS_STREAM``: a remote get_rows gathered by the session's helper thread in pieces while the
request thread sends each one (datapath_reads.stream_rows) -- bit-exact for every dtype and size around a piece,
taken by the short way, one whole version per read while a writer commits new ones, and the setting parsed."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorwire.errors import ConfigError
from tensorwire.serve.client.client import Client
from tensorwire.serve.daemon import datapath_fast, datapath_reads
from tensorwire.settings import setting

from serve_common import in_process

pytestmark = pytest.mark.timeout(120)

PIECE = 4096


@pytest.fixture(scope="module")
def srv():
    with in_process(transport="tcp", max_bytes="256MiB") as s:
        s.service.rows_stream = PIECE  # (read from TENSORWIRE_SERVE_ROWS_STREAM when the service starts)
        yield s


@pytest.fixture
def streamed(monkeypatch):
    """How many rows each streamed get_rows sent."""
    seen: list[int] = []
    real = datapath_reads.stream_rows

    def spy(s, t, table, index, out, *args, **kwargs):
        real(s, t, table, index, out, *args, **kwargs)
        seen.append(index.numel())

    monkeypatch.setattr(datapath_fast, "stream_rows", spy)
    return seen


def test_rows_streamed_in_pieces_arrive_bit_exact(srv, streamed):
    g = torch.Generator().manual_seed(11)
    with Client(srv.address, transport="tcp") as c:
        for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
            tab = (torch.rand(5000, 9, generator=g) * 200).to(dtype)
            rb = tab[0].numel() * tab.element_size()
            name = f"stream/{dtype}"
            c.put(name, tab)
            c.get_rows(name, [0])  # the client learns the spec: its next reads are posted
            streamed.clear()
            sizes = (1, PIECE * 3 // 2 // rb, PIECE * 3 // 2 // rb + 1, 3 * PIECE // rb + 1, 5000)
            for n in sizes:
                idx = torch.randint(0, 5000, (n,), generator=g)
                out = torch.empty(n, 9, dtype=dtype)
                assert c.get_rows(name, idx, out=out) is out
                assert torch.equal(out, tab[idx]), (dtype, n)
            # streamed exactly when more than 1.5 pieces
            assert streamed == [n for n in sizes if n * rb > PIECE * 3 // 2], (dtype, streamed)
            c.delete(name)


def test_every_streamed_read_is_one_whole_version(srv, streamed):
    rows, width = 4000, 32  # 128-byte rows: a read of all of them goes in 125 pieces
    with Client(srv.address, transport="tcp") as c, Client(srv.address, transport="tcp") as w:
        w.put("stream/versions", torch.zeros(rows, width))
        c.get_rows("stream/versions", [0])
        stop = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            v = 0
            try:
                while not stop.is_set():
                    v += 1
                    w.put("stream/versions", torch.full((rows, width), float(v)))
            except BaseException as exc:  # noqa: BLE001 - re-raised by the test
                errors.append(exc)

        th = threading.Thread(target=writer)
        th.start()
        try:
            idx = torch.randperm(rows)
            out = torch.empty(rows, width)
            seen = set()
            for _ in range(60):
                c.get_rows("stream/versions", idx, out=out)
                first = out[0, 0].item()
                assert bool((out == first).all()), "a read mixed two versions"
                seen.add(first)
        finally:
            stop.set()
            th.join(30)
        assert not errors, errors
        assert len(streamed) >= 60 and len(seen) > 1  # the reads streamed, and saw the writer's versions


def test_the_setting_is_a_size():
    assert setting("serve_rows_stream", {}) == 0
    assert setting("serve_rows_stream", {"TENSORWIRE_SERVE_ROWS_STREAM": "512K"}) == 512 << 10
    with pytest.raises(ConfigError, match="TENSORWIRE_SERVE_ROWS_STREAM"):
        setting("serve_rows_stream", {"TENSORWIRE_SERVE_ROWS_STREAM": "lots"})
