#!/usr/bin/env python
"""Where the GPU time of a copy-engine message goes: variants of the bare mechanism, no tensorwire in between.

::

    torchrun --standalone --nproc-per-node 2 bench/ce_chain_gpu.py [--iters 300]

Each variant is a ping-pong between two processes (one GPU each, or one shared), every call queued up front
and the clock read after the last synchronize, so what is timed is the GPU's chain, not the host:

- **push**: the sender copies into the peer's mapped buffer and writes the peer's flag (one hop per message);
- **pull**: the sender writes a "ready" flag; the receiver waits for it and copies from the sender's mapped
  buffer into its own (one hop, the copy reads remote memory);
- **pull, 2 hops**: as the backend when the receiver comes second -- the receiver's internal stream (after an
  event of its caller stream) waits for "ready", pulls, writes "landed"; its caller stream waits for "landed";
- **push, 2 hops**: as the backend when the sender comes second -- the receiver writes "dst ready"; the
  sender's internal stream waits for it, pushes, writes "landed", which the receiver's caller stream waits for.

Flags live in a shared host region (as the backend's do). Rank 0 prints one line per variant and size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from tensorwire.transport.ce import CeDriver
from tensorwire.transport.ce.region import HEADER, Region

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    d = CeDriver.get()
    d.context(device.index)
    if rank == 0:
        region = Region.create()
        store.set("chain/region", region.path)
        store.wait(["chain/attached"])
    else:
        store.wait(["chain/region"])
        region = Region.attach(store.get("chain/region").decode())
        store.set("chain/attached", "1")
    dev = d.register_host(region.addr, len(region.buf))
    n_max = max(SIZES)
    mine = torch.zeros(n_max, dtype=torch.uint8, device=device)
    base, _size, _id = d.allocation(mine.data_ptr())
    store.set(f"chain/h/{rank}", d.export(base).hex() + f":{mine.data_ptr() - base}")
    store.wait([f"chain/h/{1 - rank}"])
    h, off = store.get(f"chain/h/{1 - rank}").decode().split(":")
    theirs = d.open(bytes.fromhex(h)) + int(off)
    caller = torch.cuda.current_stream(device).cuda_stream
    inner, event = d.new_stream(), d.new_event()
    # flag words: per variant a fresh block of 4 words per rank (they only ever grow within a block)
    blocks = iter(range(HEADER, HEADER + 64 * 64, 64))

    def flags() -> tuple[int, int]:
        b = next(blocks)
        return dev + b + 16 * rank, dev + b + 16 * (1 - rank)

    def run(variant: str, n: int) -> float:
        me, peer = flags()  # me: words this rank's peer writes for it / peer: words this rank writes for the peer
        dist.barrier()
        torch.cuda.synchronize(device)
        seq = 0

        def send() -> None:
            if variant == "push":
                d.copy(caller, theirs, mine.data_ptr(), n)
                d.write(caller, peer, seq)
            elif variant.startswith("pull"):
                d.write(caller, peer, seq)  # ready (the receiver pulls)
                if variant == "pull, 2 hops":
                    d.wait(caller, me + 4, seq)  # (no reuse before the peer has it: its "landed" back to us)
            else:  # push, 2 hops: wait for "dst ready" on the internal stream, push, landed
                d.order(inner, caller, event)
                d.wait(inner, me, seq)
                d.copy(inner, theirs, mine.data_ptr(), n)
                d.write(inner, peer + 8, seq)

        def recv() -> None:
            if variant == "push":
                d.wait(caller, me, seq)
            elif variant == "pull":
                d.wait(caller, me, seq)
                d.copy(caller, mine.data_ptr(), theirs, n)
            elif variant == "pull, 2 hops":
                d.order(inner, caller, event)
                d.wait(inner, me, seq)
                d.copy(inner, mine.data_ptr(), theirs, n)
                d.write(inner, me + 8, seq)  # landed (local word, written by this GPU)
                d.write(inner, peer + 4, seq)  # and "taken" to the sender
                d.wait(caller, me + 8, seq)
            else:
                d.write(caller, peer, seq)  # dst ready
                d.wait(caller, me + 8, seq)  # landed

        t0 = 0.0
        for i in range(args.iters + 5):
            if i == 5:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            seq += 1
            if rank == 0:
                send()
                seq += 1
                recv()
            else:
                recv()
                seq += 1
                send()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / (2 * args.iters)

    for n in SIZES:
        for variant in ("push", "pull", "pull, 2 hops", "push, 2 hops"):
            us = run(variant, n) * 1e6
            if rank == 0:
                print(f"chain {variant:<14s} {n >> 10:6d} KiB  one-way {us:7.1f} us", flush=True)
    dist.barrier()
    d.unregister_host(region.addr)
    region.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
