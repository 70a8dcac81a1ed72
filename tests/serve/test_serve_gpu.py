"""CUDA tensors through the store: staged through pinned host memory (skipped without a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from tensorwire.serve.client.client import Client

from serve_common import in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.timeout(120)
def test_cuda_tensors_put_get_rows_staged_through_pinned_memory():
    dev = torch.device("cuda")
    with in_process(transport="auto") as s, Client(s.address, transport="auto") as c:
        x = torch.randint(-1000, 1000, (512, 64), device=dev).float()  # integral: sums are exact in any order
        st = c.put("g", x)
        assert st.spec.device == "cpu"  # the store holds host memory, whatever the writer's device
        entry = s.service.store.get("g")
        assert entry.slot(entry.cur).pinned, "server slots are pinned when CUDA exists"
        host = c.get("g")
        assert host.device.type == "cpu" and host.is_pinned() and torch.equal(host.to(dev), x)
        out = torch.empty(512, 64, device=dev)
        assert c.get("g", out=out) is out and torch.equal(out, x)
        idx = torch.tensor([0, 511, 7], device=dev)
        rows = c.get_rows("g", idx)
        assert rows.is_pinned() and torch.equal(rows.to(dev, non_blocking=True), x[idx])
        rout = torch.empty(3, 64, device=dev)
        c.get_rows("g", idx, out=rout)
        assert torch.equal(rout, x[idx])
        upd = torch.ones(2, 64, device=dev)
        c.add_rows("g", torch.tensor([1, 1], device=dev), upd)
        c.put_rows("g", [2], torch.zeros(1, 64, device=dev))
        x[1] += 2
        x[2] = 0
        assert torch.equal(c.get("g").to(dev), x)
        c.put("g", x.t().contiguous().t())  # non-contiguous CUDA source
        assert torch.equal(c.get("g").to(dev), x)
        c.put("h", torch.arange(10, device=dev, dtype=torch.bfloat16))
        assert torch.equal(c.get("h"), torch.arange(10, dtype=torch.bfloat16))


@pytest.mark.timeout(120)
def test_cuda_destinations_read_from_leases_and_see_every_write():
    from tensorwire.serve.client.shm_path import leases_wanted as _leases_wanted

    dev = torch.device("cuda")
    with in_process(transport="auto") as s, Client(s.address) as c, Client(s.address) as w:
        if c.data_path != "shm" or not _leases_wanted():
            pytest.skip(f"no read leases here (data path {c.data_path})")
        x = torch.randint(-1000, 1000, (256, 32), device=dev).float()
        w.put("L", x)
        out = torch.empty_like(x)
        rows = torch.empty(4, 32, device=dev)
        idx = torch.tensor([255, 0, 3, 3], device=dev)
        c.get("L", out=out)
        for k in range(5):
            w.add_rows("L", torch.tensor([k], device=dev), torch.ones(1, 32, device=dev))  # in place: the lease ends
            x[k] += 1
            for _ in range(2):  # the first asks the daemon, the second is read from the new lease
                assert c.get("L", out=out) is out and torch.equal(out, x)
                assert torch.equal(c.get_rows("L", idx, out=rows), x[idx])
        assert c.lease_reads >= 15 and c.lease_misses >= 5, (c.lease_reads, c.lease_misses)


@pytest.mark.timeout(120)
def test_cuda_sources_put_through_write_ahead_grants():
    """A training loop's repeated put of CUDA weights: after the first, each is one copy (device to the granted
    shared slot, page-locked) and one COMMIT; every version arrives whole, from contiguous and strided sources."""
    dev = torch.device("cuda")
    with in_process(transport="auto") as s, Client(s.address) as w, Client(s.address) as r:
        if w.data_path != "shm":
            pytest.skip(f"no shared memory here (data path {w.data_path})")
        x = torch.randn(1024, 256, device=dev)
        for k in range(8):
            src = (x + k) if k % 2 else (x + k).t().contiguous().t()  # every other one strided
            assert w.put("wa", src).version == k + 1
            assert torch.equal(r.get("wa").to(dev), x + k)
            time.sleep(0.02)  # the reader's pin goes back (idle RELEASE): a pinned slot is not granted
        assert w.ahead_puts >= 6, w.ahead_puts
