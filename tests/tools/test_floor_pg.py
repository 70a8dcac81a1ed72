"""``bench/floor_pg.py``: the Python floor that ``bench/bench_distributed.py`` times beside gloo and tensorwire."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    sys.path.insert(0, {bench!r})
    import floor_pg

    floor_pg.register()
    floor_pg.register()  # a second call is a no-op
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = dist.new_group([0, 1], backend=floor_pg.NAME)
    for n in (1, 1024, 300_000):  # 300,000 float32: more than one socket read
        x = torch.arange(n, dtype=torch.float32) + 7 * rank
        y = torch.empty(n)
        if rank == 0:
            dist.send(x, 1, group=g)
            dist.recv(y, 1, group=g)
        else:
            dist.recv(y, 0, group=g)
            dist.send(x, 0, group=g)
        assert torch.equal(y, torch.arange(n, dtype=torch.float32) + 7 * (1 - rank)), n
    # the socket calls alone (what bench_distributed.py times without torch): the same bytes, no dispatch
    import bench_distributed

    x = torch.arange(4096, dtype=torch.float32) + 3 * rank
    seconds = bench_distributed._socket_pingpong(g, rank, x, 5)
    assert seconds > 0
    # each rank ends holding what the other sent last: rank 1 echoes rank 0's own bytes back to it
    assert torch.equal(x, torch.arange(4096, dtype=torch.float32)), x[:4]
    dist.destroy_process_group(g)
    dist.destroy_process_group()
    open(f"ok{{rank}}", "w").write("ok")
    """
)


@pytest.mark.timeout(120)
def test_the_floor_group_moves_bytes_both_ways_and_is_destroyed(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(bench=os.path.join(ROOT, "bench")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert [(tmp_path / f"ok{r}").exists() for r in (0, 1)] == [True, True]  # each rank checked its bytes
