"""An embedding table held by ``tensorwire serve``, trained with lazy Adam on gathered rows.

The SpeedTorch idea: a table too big for the GPU lives in (pinned) host
memory; each step only the rows the batch touches travel to the GPU and only
their updates travel back. Here the table lives in a ``tensorwire serve``
daemon (pinned host memory when CUDA exists), so any number of workers, on
any host, can train against it.

Each step of the worker loop:

1. draw a batch of item ids (Zipf-like: a few hot rows, a long tail);
2. ``get_rows`` the unique ids from ``emb`` and from the Adam moments
   ``emb.m`` / ``emb.v`` (also held by the daemon): only those rows travel;
3. run the model step on them (on the GPU if there is one): a small dense
   tower predicts a target from the embedding; autograd gives the gradient of
   the gathered rows only;
4. compute Adam for those rows locally and send it back: ``add_rows`` the
   parameter *delta* into ``emb`` and ``put_rows`` the new moments.

Why not ``torch.optim.Adam``? It needs the parameter it updates to be a local
dense tensor: on a 200k x 64 table it would keep two more full-size moment
tensors and update every row each step (Adam's moments decay even where the
gradient is zero). ``torch.optim.SparseAdam`` needs a local ``nn.Embedding``
with sparse gradients, i.e. the whole table in this process. Neither can run
against rows that live somewhere else. What we run instead is "lazy Adam"
(the SparseAdam algorithm): the moments of the rows in the batch are updated,
the others are left alone (no decay for untouched rows); bias correction uses
the global step. The table update is sent as a delta with ``add_rows``, so
updates from several workers to the same row accumulate instead of
overwriting one another (the moments use ``put_rows``: last writer wins, the
usual Hogwild trade-off for optimizer state).

Run it::

    python examples/embedding_server.py                 # starts its own daemon (200k x 64)
    python examples/embedding_server.py --rows 5000000  # bigger table
    python examples/embedding_server.py --address 127.0.0.1:7100 --token-file tok

It prints the loss per step and exits when done.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

import tensorwire as tw  # noqa: E402


def start_daemon(rows: int, dim: int) -> tuple[subprocess.Popen, str]:
    """``tensorwire serve`` on free ports, sized for the table, its moments and their staging slots."""
    need = 3 * 2 * rows * dim * 4 + (64 << 20)
    cmd = [sys.executable, "-m", "tensorwire", "serve", "--port", "0", "--max-bytes", str(need)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True, env=env
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise SystemExit("the daemon did not start (run `python -m tensorwire serve` by hand to see why)")
    info = json.loads(line)
    return proc, f"127.0.0.1:{info['port']}"


class Tower(torch.nn.Module):
    """The dense part of the model (trained locally with a regular torch optimizer)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        return self.net(e)


def targets(ids: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """A fixed, learnable target per item: a random projection of a hash of its id."""
    g = torch.sin(ids.double().unsqueeze(1) * torch.arange(1, 17, dtype=torch.float64, device=ids.device)).float()
    return g @ proj


def run(args: argparse.Namespace) -> float:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    token = None
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    proc = None
    address = args.address
    if address is None:
        proc, address = start_daemon(args.rows, args.dim)
        print(f"started tensorwire serve on {address}")
    try:
        with tw.Client(address, token=token, transport=args.transport, timeout=120) as c:
            gen = torch.Generator().manual_seed(args.seed)
            if "emb" not in c.list() or args.reinit:
                print(f"initialising emb [{args.rows} x {args.dim}] float32 on the server")
                c.put("emb", torch.randn(args.rows, args.dim, generator=gen) * 0.01)
                c.put("emb.m", torch.zeros(args.rows, args.dim))
                c.put("emb.v", torch.zeros(args.rows, args.dim))
            tower = Tower(args.dim).to(device)
            opt = torch.optim.Adam(tower.parameters(), lr=1e-3)
            proj = torch.randn(16, 8, generator=gen).to(device)
            b1, b2, eps, lr = 0.9, 0.999, 1e-8, args.lr
            # Zipf-like item popularity: hot rows are revisited, so learning shows in the loss
            weights = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.1
            first = last = None
            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                batch = torch.multinomial(weights, args.batch, replacement=True, generator=gen)
                uniq, inverse = torch.unique(batch, return_inverse=True)
                rows = c.get_rows("emb", uniq).to(device, non_blocking=True)
                m = c.get_rows("emb.m", uniq).to(device, non_blocking=True)
                v = c.get_rows("emb.v", uniq).to(device, non_blocking=True)
                rows.requires_grad_(True)
                pred = tower(rows[inverse.to(device)])
                loss = torch.nn.functional.mse_loss(pred, targets(batch.to(device), proj))
                opt.zero_grad()
                loss.backward()
                opt.step()
                g = rows.grad.detach()
                # lazy Adam on the gathered rows only
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                m_hat = m / (1 - b1**step)
                v_hat = v / (1 - b2**step)
                delta = (-lr * m_hat / (v_hat.sqrt() + eps)).cpu()
                c.add_rows("emb", uniq, delta)
                c.put_rows("emb.m", uniq, m.cpu())
                c.put_rows("emb.v", uniq, v.cpu())
                last = float(loss)
                first = last if first is None else first
                print(f"step {step:4d}  loss {last:.5f}  rows {uniq.numel():5d}")
            dt = time.perf_counter() - t0
            print(
                f"done: {args.steps} steps in {dt:.2f}s ({args.steps / dt:.1f} steps/s) on {device}, "
                f"loss {first:.5f} -> {last:.5f}, data path {c.data_path}, emb version {c.stat('emb').version}"
            )
            return last if last is not None else float("nan")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            if proc.stdout:
                proc.stdout.close()


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="host:port of a running daemon (default: start one)")
    p.add_argument("--token-file", help="bearer token file for the daemon")
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "shm", "ucx", "tcp"),
        help="auto: shared memory with a daemon on this host, else UCX/TCP",
    )
    p.add_argument("--rows", type=int, default=200_000, help="table rows (default 200k; try 5000000)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reinit", action="store_true", help="re-initialise the table on an existing daemon")
    p.add_argument("--cpu", action="store_true", help="run the model step on the CPU even with a GPU")
    args = p.parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
