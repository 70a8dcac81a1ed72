"""16 concurrent clients x 200 mixed operations against one daemon, every byte checked.

Half the clients move their bytes through shared memory (where /dev/shm has room), half over TCP, on the
same shared tensors."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from serve_common import Daemon, shm_room

SHM_OK = shm_room()

CLIENTS = 16
OPS = 200
SHARED = 4
SHARED_N = 4096  # int64 elements of each shared tensor (32 KiB)


def _shared_value(writer: int, seq: int) -> torch.Tensor:
    """A version of a shared tensor: every element encodes (writer, seq), so a torn read shows."""
    stamp = writer * 1_000_000 + seq
    return torch.arange(SHARED_N, dtype=torch.int64) + stamp * SHARED_N


def _check_shared(name: str, t: torch.Tensor) -> int:
    stamp = t - torch.arange(SHARED_N, dtype=torch.int64)
    first = int(stamp[0])
    assert first % SHARED_N == 0 and bool((stamp == first).all()), f"{name}: torn read (mixed versions)"
    return first // SHARED_N


def _client_run(address: str, cid: int, errors: list, counts: list) -> None:
    import tensorwire as tw

    rng = random.Random(1000 + cid)
    g = torch.Generator().manual_seed(cid)
    mine = f"c{cid}/dense"
    table = f"c{cid}/table"
    try:
        with tw.Client(address, transport="shm" if cid % 2 and SHM_OK else "tcp", timeout=60) as c:
            local = torch.randn(64, 32, generator=g)
            c.put(mine, local)
            tab = torch.randint(-100, 100, (256, 16), generator=g).float()
            c.put(table, tab)
            version = c.stat(mine).version
            seq = 0
            for _ in range(OPS):
                op = rng.choice(
                    [
                        "put",
                        "get",
                        "get_out",
                        "get_rows",
                        "put_rows",
                        "add_rows",
                        "put_shared",
                        "get_shared",
                        "stat",
                        "list",
                        "delete_reput",
                    ]
                )
                if op == "put":
                    local = torch.randn(64, 32, generator=g)
                    st = c.put(mine, local)
                    assert st.version > version
                    version = st.version
                elif op == "get":
                    got = c.get(mine)
                    assert torch.equal(got, local), f"{mine}: get returned other bytes"
                elif op == "get_out":
                    out = torch.empty(64, 32)
                    assert c.get(mine, out=out) is out
                    assert torch.equal(out, local)
                elif op == "get_rows":
                    idx = torch.randint(0, 256, (rng.randint(1, 64),), generator=g)
                    assert torch.equal(c.get_rows(table, idx), tab[idx])
                elif op == "put_rows":
                    idx = torch.randperm(256, generator=g)[: rng.randint(1, 32)]
                    vals = torch.randint(-100, 100, (idx.numel(), 16), generator=g).float()
                    c.put_rows(table, idx, vals)
                    tab[idx] = vals
                elif op == "add_rows":
                    idx = torch.randint(0, 256, (rng.randint(1, 32),), generator=g)
                    vals = torch.randint(-5, 5, (idx.numel(), 16), generator=g).float()
                    c.add_rows(table, idx, vals)
                    tab.index_add_(0, idx, vals)
                    assert torch.equal(c.get(table), tab), f"{table}: add_rows result differs"
                elif op == "put_shared":
                    seq += 1
                    c.put(f"shared/{rng.randrange(SHARED)}", _shared_value(cid, seq))
                elif op == "get_shared":
                    name = f"shared/{rng.randrange(SHARED)}"
                    try:
                        _check_shared(name, c.get(name))
                    except tw.NotFoundError:
                        pass  # nobody wrote it yet
                elif op == "stat":
                    st = c.stat(mine)
                    assert st.version == version and st.spec.shape == (64, 32) and st.nbytes == 64 * 32 * 4
                elif op == "list":
                    names = c.list()
                    assert mine in names and table in names
                elif op == "delete_reput":
                    c.delete(mine)
                    with pytest.raises(tw.NotFoundError):
                        c.get(mine)
                    st = c.put(mine, local)
                    assert st.version == 1
                    version = 1
                counts[cid] += 1
            assert torch.equal(c.get(mine), local) and torch.equal(c.get(table), tab)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append((cid, exc))


@pytest.mark.timeout(180)
def test_16_clients_200_mixed_ops_every_byte_checked():
    with Daemon("--max-bytes", "512MiB") as d:
        errors: list = []
        counts = [0] * CLIENTS
        t0 = time.monotonic()
        threads = [threading.Thread(target=_client_run, args=(d.address, i, errors, counts)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads), "clients hung"
        assert not errors, f"{errors[0][0]}: {errors[0][1]!r}\n{d.log()[-3000:]}"
        assert sum(counts) == CLIENTS * OPS
        # the daemon is still healthy and every shared tensor is whole
        import tensorwire as tw

        with tw.Client(d.address, transport="tcp") as c:
            for k in range(SHARED):
                try:
                    _check_shared(f"shared/{k}", c.get(f"shared/{k}"))
                except tw.NotFoundError:
                    pass
            assert len(c.list()) == 2 * CLIENTS + sum(1 for k in range(SHARED) if f"shared/{k}" in c.list())
        print(f"{CLIENTS} clients x {OPS} ops in {elapsed:.1f}s")
