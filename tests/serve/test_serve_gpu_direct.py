"""The GPU reading the daemon's memory in place (tensorwire/serve/client/shm_gpu.py, ``GpuGather.gather``):
get_rows into a CUDA tensor is one index_select kernel over a CUDA view of the daemon's shared-memory slot,
registered with CUDA once per mapping. Skipped without a GPU; run on a GPU host with
``python3 -m pytest tests/serve/test_serve_gpu_direct.py -m gpu -q``."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import pytest
import torch

import tensorwire as tw
from tensorwire.serve.client import shm_maps
from tensorwire.serve.client.client import Client
from tensorwire.serve.client.shm_path import LEASES_ENV

from serve_common import ALL_DTYPES, ROOT, Daemon, clean_env, in_process, shm_room

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not shm_room(), reason="no room in /dev/shm"),
]


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


class _Spy:
    """Records the CUDA sources torch.index_select reads (their data pointers)."""

    def __init__(self, monkeypatch) -> None:
        self.cuda_sources: list[int] = []
        real = torch.index_select

        def spy(src, *a, **kw):
            if src.is_cuda:
                self.cuda_sources.append(src.data_ptr())
            return real(src, *a, **kw)

        monkeypatch.setattr(torch, "index_select", spy)


def _registered(c: Client) -> list:
    return [m for m in c._mem.maps._cuda.values() if m is not None]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("leases", ["1", "0"], ids=["lease-reads", "pinned-reads"])
def test_get_rows_into_cuda_reads_the_daemons_memory_in_place_bit_exact_for_every_dtype(monkeypatch, leases):
    monkeypatch.setenv(LEASES_ENV, leases)
    dev = torch.device("cuda")
    spy = _Spy(monkeypatch)
    regs: list = []
    with in_process(transport="auto", max_bytes="1GiB") as s, Client(s.address, transport="shm") as c:
        for k, dtype in enumerate(ALL_DTYPES):
            name = f"gd/{dtype}"
            x = _values(dtype, (2_000, 3, 5), k)  # rows of 15 elements: odd byte widths for the 1- and 2-byte dtypes
            c.put(name, x)
            for idx in ([0], [1_999, 0, 7, 7], torch.randint(0, 2_000, (1_500,))):
                i = torch.as_tensor(idx)
                out = torch.full((len(i), 3, 5), 0, dtype=dtype, device=dev)
                for _ in range(2):  # the first asks the daemon, the second may be a lease read
                    before = len(spy.cuda_sources)
                    assert c.get_rows(name, i, out=out) is out
                    assert torch.equal(out.cpu(), x[i]), (dtype, idx)
                    assert len(spy.cuda_sources) == before + 1  # one kernel over the daemon's pages
            whole = torch.empty_like(x, device=dev)
            assert c.get(name, out=whole) is whole and torch.equal(whole.cpu(), x)
            c.put(name, whole.flip(0))  # a CUDA source: device to the registered slot
            assert torch.equal(c.get(name), x.flip(0))
            regs += _registered(c)  # (before the delete: a deleted tensor's mapping goes with it)
            c.delete(name)
        assert regs and all(m.device == torch.cuda.current_device() for m in regs)
        if leases == "1":
            assert c.lease_reads > 0


@pytest.mark.timeout(120)
def test_a_non_contiguous_cuda_destination_gets_the_same_rows():
    dev = torch.device("cuda")
    with in_process(transport="auto") as s, Client(s.address, transport="shm") as c:
        x = _values(torch.float32, (500, 8), 1)
        c.put("nc", x)
        idx = torch.tensor([4, 499, 0])
        out = torch.zeros(8, 3, device=dev).t()  # (3, 8), strided
        assert c.get_rows("nc", idx, out=out) is out and torch.equal(out.cpu(), x[idx])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_cuda_destinations_over_the_data_connections_are_bit_exact(transport):
    from serve_common import ucx_usable

    if transport == "ucx" and not ucx_usable():
        pytest.skip("UCX not usable here")
    dev = torch.device("cuda")
    with in_process(transport=transport) as s, Client(s.address, transport=transport) as c:
        for k, dtype in enumerate(ALL_DTYPES):
            x = _values(dtype, (700, 6), k)
            c.put("dc", x)
            i = torch.randint(0, 700, (333,))
            out = torch.empty(333, 6, dtype=dtype, device=dev)
            assert c.get_rows("dc", i, out=out) is out and torch.equal(out.cpu(), x[i])
            c.delete("dc")


@pytest.mark.timeout(240)
def test_cuda_destinations_from_a_table_sharded_over_three_daemons():
    dev = torch.device("cuda")
    ds = [Daemon("--max-bytes", "512MiB", transport="tcp") for _ in range(3)]
    try:
        with tw.Client([d.address for d in ds], timeout=20) as c:
            for k, dtype in enumerate(ALL_DTYPES):
                x = _values(dtype, (3_001, 4), k)
                c.put("sh", x, shard="rows")
                i = torch.randint(0, 3_001, (2_000,))
                for _ in range(2):
                    out = torch.empty(2_000, 4, dtype=dtype, device=dev)
                    assert c.get_rows("sh", i, out=out) is out and torch.equal(out.cpu(), x[i])
                c.delete("sh")
    finally:
        for d in ds:
            d.close()


_WRITER = """
import sys, time, torch
import tensorwire as tw
c = tw.Client(sys.argv[1], transport="shm", timeout=30)
rows, width, seconds = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
v = 1
stop = time.monotonic() + seconds
while time.monotonic() < stop:
    v += 1
    c.put("torn", torch.full((rows, width), float(v)))
print(v, flush=True)
c.close()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("leases", ["1", "0"], ids=["lease-reads", "pinned-reads"])
def test_a_gpu_reader_never_sees_two_versions_while_a_writer_commits(monkeypatch, leases):
    monkeypatch.setenv(LEASES_ENV, leases)
    dev = torch.device("cuda")
    rows, width = 20_000, 256  # 20 MB a version: each put takes a while, the gathers run during it
    with in_process(transport="auto", max_bytes="1GiB") as s, Client(s.address, transport="shm") as c:
        c.put("torn", torch.full((rows, width), 1.0))
        w = subprocess.Popen(
            [sys.executable, "-c", _WRITER, s.address, str(rows), str(width), "4"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=clean_env(),
        )
        try:
            out = torch.empty(4_096, width, device=dev)
            reads, seen = 0, set()
            while w.poll() is None:
                idx = torch.randint(0, rows, (4_096,))
                c.get_rows("torn", idx, out=out)
                lo, hi = out.min().item(), out.max().item()
                assert lo == hi, f"rows of two versions in one read: {lo} and {hi}"
                seen.add(lo)
                reads += 1
            last = int(w.stdout.read().strip())
        finally:
            if w.poll() is None:
                w.kill()
            w.wait(30)
            w.stdout.close()
        assert w.returncode == 0 and last > 3 and reads > 10 and len(seen) > 1, (last, reads, len(seen))


@pytest.mark.timeout(120)
def test_the_daemon_killed_while_the_gpu_reads_its_memory_is_a_peer_lost_error_and_cuda_lives():
    dev = torch.device("cuda")
    with Daemon("--max-bytes", "1GiB", transport="tcp") as d:
        c = Client(d.address, transport="shm", timeout=5, connect_timeout=5)
        try:
            x = torch.randn(100_000, 128)
            c.put("k", x)
            out = torch.empty(8_192, 128, device=dev)
            idx = torch.randint(0, 100_000, (8_192,))
            assert torch.equal(c.get_rows("k", idx, out=out).cpu(), x[idx])
            deadline = time.monotonic() + 30
            d.signal(signal.SIGKILL)
            with pytest.raises(tw.PeerLostError):
                while time.monotonic() < deadline:
                    c.get_rows("k", torch.randint(0, 100_000, (8_192,)), out=out)
        finally:
            c.close()
    torch.cuda.synchronize()  # nothing went wrong in CUDA
    assert torch.equal(torch.ones(4, device=dev).sum().cpu(), torch.tensor(4.0))


@pytest.mark.timeout(120)
def test_cuda_refusing_the_registration_falls_back_to_pinned_staging_with_one_log_line(monkeypatch, caplog):
    def refuse(*a, **kw):
        raise OSError("cudaHostRegister failed with CUDA error 2 (a test)")

    monkeypatch.setattr(shm_maps, "map_host", refuse)
    monkeypatch.setattr(shm_maps, "_REFUSED_LOGGED", False)
    spy = _Spy(monkeypatch)
    dev = torch.device("cuda")
    caplog.set_level(logging.WARNING, logger="tensorwire.serve.client.shm_maps")
    with in_process(transport="auto") as s, Client(s.address, transport="shm") as c:
        x = _values(torch.float32, (1_000, 16), 2)
        c.put("fb", x)
        c.put("fb2", x + 1)
        out = torch.empty(3, 16, device=dev)
        for name, want in (("fb", x), ("fb2", x + 1), ("fb", x)):
            assert torch.equal(c.get_rows(name, [1, 999, 5], out=out).cpu(), want[[1, 999, 5]])
        whole = torch.empty(1_000, 16, device=dev)
        assert torch.equal(c.get("fb", out=whole).cpu(), x)
        assert not spy.cuda_sources and not _registered(c)
    lines = [r for r in caplog.records if "CUDA refused to map" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.timeout(60)
def test_a_cuda_destination_of_the_wrong_shape_or_dtype_is_refused_and_nothing_is_written():
    dev = torch.device("cuda")
    with in_process(transport="auto") as s, Client(s.address, transport="shm") as c:
        c.put("w", torch.randn(100, 8))
        for out in (torch.full((3, 9), 7.0, device=dev), torch.full((3, 8), 7, dtype=torch.int32, device=dev)):
            for _ in range(2):  # the pinned read and the lease read
                with pytest.raises(tw.ShapeMismatchError):
                    c.get_rows("w", [0, 1, 2], out=out)
                assert bool((out == 7).all())
        whole = torch.full((100, 9), 7.0, device=dev)
        with pytest.raises(tw.ShapeMismatchError):
            c.get("w", out=whole)
        assert bool((whole == 7).all())


@pytest.mark.timeout(180)
def test_a_lease_read_into_cuda_reuses_nothing_it_should_not():
    """The lease reader keeps a word view of the last destination, the index slice per length and the current
    stream: each must follow a new destination (even one at the same address), a new length, a larger index
    than its buffer holds, and another stream; a row out of range is refused before the kernel."""
    from tensorwire.errors import SpecError

    dev = torch.device("cuda")
    with in_process(transport="auto", max_bytes="1GiB") as s, Client(s.address, transport="shm") as c:
        if not c._mem.use_leases:
            pytest.skip("read leases are off here")
        x = _values(torch.bfloat16, (70_000, 6), 3)  # 12-byte rows: int32 words
        c.put("lr", x)
        c.get_rows("lr", [0], out=torch.empty(1, 6, dtype=torch.bfloat16, device=dev))  # takes the lease
        reads = c.lease_reads
        g = torch.Generator().manual_seed(5)
        for n in (1, 4_096, 3, 4_096, 69_999):  # the last one is larger than the first index buffer
            i = torch.randint(0, 70_000, (n,), generator=g)
            out = torch.full((n, 6), -1, dtype=torch.bfloat16, device=dev)
            assert c.get_rows("lr", i, out=out) is out and torch.equal(out.cpu(), x[i]), n
            del out  # the next destination of the same size may get the same address
        side = torch.cuda.Stream()
        i = torch.tensor([69_999, 5, 5, 0])
        out = torch.zeros(4, 6, dtype=torch.bfloat16, device=dev)
        with torch.cuda.stream(side):
            c.get_rows("lr", i, out=out)
        side.synchronize()
        assert torch.equal(out.cpu(), x[i])
        assert c.lease_reads == reads + 6, (c.lease_reads, reads)
        for bad in ([70_000], [-1], [3, 2**62]):
            kept = torch.full((len(bad), 6), 7, dtype=torch.bfloat16, device=dev)
            with pytest.raises(SpecError, match="out of range"):
                c.get_rows("lr", bad, out=kept)
            assert torch.equal(kept.cpu(), torch.full((len(bad), 6), 7, dtype=torch.bfloat16))
        assert torch.equal(c.get_rows("lr", i, out=out).cpu(), x[i])  # the lease still serves after a refusal
