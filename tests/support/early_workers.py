"""Messages of every kind arriving before and after their receive is posted, through ``backend="tensorwire"``.

Across hosts a peer's message often lands before the receive it is for is posted (into an eager buffer, copied
when the receive is posted); on one host it rarely does. Here the order is forced: a rank first waits for a
marker its peer sends right after the message (the transport reads the socket in order, so the message is in
by then), and only then posts its receive; or it posts first and then sends the marker that lets its peer send.

Run by the harness (:func:`exchange`, spawned processes on loopback) or under torchrun (``python early_workers.py
--rounds N``: two nodes in network namespaces, tests/distributed/test_early_messages.py), where each rank prints
one ``early-exchange rank=R ok rounds=N`` line, or a ``early-exchange rank=R failed`` line with the error.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import tensorwire  # (importing it registers the backend)
import tensorwire.native

DATA_TAG = 3
MARK_TAG = 4


def tensors(rank: int) -> list[torch.Tensor]:
    """Every message kind: large (past the eager size), eager-sized, small of every dtype, 0-d, empty, and
    one large enough for cross-memory attach. Values depend on ``rank``."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        torch.randn(256, 1024, generator=g),  # 1 MiB: waits for its credit
        torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        torch.randn(17, generator=g).to(torch.float16),
        torch.randn(2, 2, generator=g, dtype=torch.float64),
        torch.tensor(7 + rank, dtype=torch.int64),  # 0-d
        torch.randint(-50, 50, (5, 3), generator=g, dtype=torch.int32),
        torch.randint(-100, 100, (64,), generator=g, dtype=torch.int8),
        torch.randint(0, 256, (9, 9), generator=g, dtype=torch.uint8),
        torch.randint(0, 2, (33,), generator=g).bool(),
        torch.empty(0, 4),  # no bytes
        torch.randn(65536, generator=g),  # 256 KiB: exactly an eager buffer
        torch.randint(0, 256, (16 << 20,), generator=g, dtype=torch.uint8),  # 16 MiB
    ]


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        raise AssertionError(f"{what}: received {got.dtype}{list(got.shape)} differs from what was sent")


def _mark_to(peer: int) -> None:
    dist.send(torch.ones(1, dtype=torch.uint8), peer, tag=MARK_TAG)


def _mark_from(peer: int) -> None:
    dist.recv(torch.zeros(1, dtype=torch.uint8), peer, tag=MARK_TAG)


def _one_way(rank: int, src: int, x: torch.Tensor, want: torch.Tensor, *, early: bool, blocking: bool) -> None:
    """``src`` sends its ``x`` to the other rank, whose receive is posted after the message came (``early``)
    or before it was sent; ``blocking``: with ``send``/``recv`` where the order allows, else ``isend``/``irecv``."""
    peer = 1 - rank
    if rank == src:
        if early:
            # (not a blocking send: one that waits for its credit -- UCX's first message on a tag, any large
            # one -- would wait for the receive, which is posted only after the marker)
            work = dist.isend(x, peer, tag=DATA_TAG)
            _mark_to(peer)
            work.wait()
        else:
            _mark_from(peer)  # the receive is posted
            if blocking:
                dist.send(x, peer, tag=DATA_TAG)
            else:
                dist.isend(x, peer, tag=DATA_TAG).wait()
        return
    y = torch.full_like(want, 3) if want.dtype != torch.bool else torch.zeros_like(want)
    if early:
        _mark_from(peer)  # read after the message: it came before the receive below is posted
        if blocking:
            dist.recv(y, peer, tag=DATA_TAG)
        else:
            dist.irecv(y, peer, tag=DATA_TAG).wait()
    else:
        work = dist.irecv(y, peer, tag=DATA_TAG)
        _mark_to(peer)
        work.wait()
    _check(y, want, f"rank {rank} from {src} ({'early' if early else 'posted first'})")


def _both_ways(rank: int, x: torch.Tensor, want: torch.Tensor, *, late: int | None) -> None:
    """Both ranks ``batch_isend_irecv`` at once; rank ``late`` first waits until the peer's message came."""
    peer = 1 - rank
    y = torch.full_like(want, 3) if want.dtype != torch.bool else torch.zeros_like(want)
    if rank == late:
        _mark_from(peer)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, x, peer, tag=DATA_TAG), dist.P2POp(dist.irecv, y, peer, tag=DATA_TAG)]
    )
    if late is not None and rank != late:
        _mark_to(peer)
    for w in works:
        w.wait()
    _check(y, want, f"rank {rank} batch (late rank {late})")


def run_rounds(rank: int, rounds: int) -> int:
    """Every kind, every way, both orders, ``rounds`` times over (an initialised group of two)."""
    peer = 1 - rank
    mine, theirs = tensors(rank), tensors(peer)
    for _ in range(rounds):
        for src in (0, 1):
            for early in (True, False):
                for blocking in (True, False):
                    for x, want in zip(mine, theirs):
                        _one_way(rank, src, x, want, early=early, blocking=blocking)
        for late in (None, 0, 1):
            for x, want in zip(mine, theirs):
                _both_ways(rank, x, want, late=late)
    return rounds


def exchange(rank: int, world: int, store: Any, transport: str, rounds: int = 1) -> dict:
    """Harness entry: a group of two over ``transport`` on loopback."""
    os.environ["TENSORWIRE_TRANSPORT"] = transport
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        done = run_rounds(rank, rounds)
        transports = dict(dist.group.WORLD.transports)  # type: ignore[union-attr]
    finally:
        dist.destroy_process_group()
    return {"rounds": done, "transports": transports}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    dist.init_process_group("tensorwire", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        done = run_rounds(rank, args.rounds)
        links = dict(dist.group.WORLD.transports)  # type: ignore[union-attr]
    except BaseException as exc:  # noqa: BLE001 - reported on one line, then the rank exits non-zero
        print(f"early-exchange rank={rank} failed {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc()
        return 1
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    build = tensorwire.native.summary()
    print(f"early-exchange rank={rank} ok rounds={done} links={links} build={build}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
