"""Ranks for the link-authentication attack tests (importable by spawned workers)."""

from __future__ import annotations

import datetime
import os

import torch

import tensorwire as tw


def token_file_job(rank, world, store, token_file, transport="tcp"):
    """Ranks 0 and 1 link and move bytes; every rank then tries link "other" between rank 0 and rank 2.

    Returns what this rank saw: the received tensor's equality, the error type of link "other",
    and whether the store holds a generated secret (it must not, with a token file).
    """
    os.environ["TENSORWIRE_LINK_TOKEN_FILE"] = token_file
    spec = tw.TensorSpec("x", (1000,), "int64")
    out = {}
    with tw.Node(rank=rank, world_size=world, store=store, transport=transport, timeout=30) as node:
        if rank in (0, 1):
            link = node.link(1 - rank, send=[spec] if rank == 0 else [], recv=[spec] if rank == 1 else [])
            if rank == 0:
                link.send("x", torch.arange(1000) * 7)
            else:
                out["bytes_ok"] = bool(torch.equal(link.recv("x"), torch.arange(1000) * 7))
            link.close()
        if rank in (0, 2):
            try:
                node.link(
                    2 - rank,
                    send=[spec] if rank == 0 else [],
                    recv=[spec] if rank == 2 else [],
                    name="other",
                    timeout=20,
                )
                out["other"] = "linked"
            except tw.TensorWireError as exc:
                out["other"] = type(exc).__name__
            # Rank 2 stays until rank 0 has tried too: a rank 2 gone before rank 0 (still busy with its
            # first link on a loaded machine) gets there would turn rank 0's AuthError into a ConnectTimeout.
            if rank == 0:
                store.set("other-tried", "1")
            else:
                store.wait(["other-tried"], datetime.timedelta(seconds=90))
        out["store_secret"] = bool(store.check([node.prefix + "link/secret"]))
    return out
