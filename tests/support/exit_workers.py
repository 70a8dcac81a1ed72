"""Short tensorwire processes whose exit status the exit tests count (``python exit_workers.py SCENARIO ...``).

Each one opens something, makes one operation and then ends as a script may:
closing (``close``), leaving it open and calling ``sys.exit(0)`` (``exit``), or
letting an exception escape the ``with`` block (``raise``, exit status 1).

Before tensorwire is imported, the script registers an ``atexit`` probe; atexit
runs the last registered first, so the probe runs after tensorwire's own exit
handler and prints ``EXIT-PROBE {...}``: the daemon threads still alive then
(each one may take the process down as the interpreter finalizes) and whether
the operation's bytes were right. The tests assert on both and on the status.

Scenarios:
    client ENDING ADDRESS          one get of "weights" (a daemon at ADDRESS holds it)
    link ENDING RANK PORT TRANSPORT one tensor from rank 0 to rank 1 over a Link (TCPStore at PORT)
    dist ENDING                    a torchrun worker: init_process_group("tensorwire"), one send/recv
"""

from __future__ import annotations

import atexit
import json
import sys
import threading

_STATE: dict[str, object] = {"ok": False}


def _probe() -> None:
    left = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive())
    print("EXIT-PROBE " + json.dumps({"threads": left, "ok": _STATE["ok"]}), flush=True)


atexit.register(_probe)  # first: so it runs last

import torch  # noqa: E402 - after the probe on purpose

import tensorwire as tw  # noqa: E402

WEIGHTS = torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256)


def _end(ending: str, closer: object) -> None:
    """Inside the ``with`` block of ``closer``: end the way the scenario says."""
    if ending == "raise":
        raise RuntimeError("the script failed on purpose")
    if ending == "exit":
        # a script that calls sys.exit without leaving the block: (unlike here) nothing closes it,
        # so forget the context manager's close and exit from inside
        sys.exit(0)


def client(ending: str, address: str) -> None:
    if ending == "exit":
        c = tw.Client(address)  # never closed: the exit handler closes it
        _STATE["ok"] = bool(torch.equal(c.get("weights"), WEIGHTS))
        sys.exit(0)
    with tw.Client(address) as c:
        _STATE["ok"] = bool(torch.equal(c.get("weights"), WEIGHTS))
        _end(ending, c)


def link(ending: str, rank: int, port: int, transport: str) -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    spec = tw.TensorSpec("w", tuple(WEIGHTS.shape), "float32")
    node = tw.Node(rank=rank, world_size=2, store=store, transport=transport, timeout=30.0)  # type: ignore[arg-type]
    lk = node.link(1 - rank, send=[spec] if rank == 0 else [], recv=[spec] if rank == 1 else [])
    if rank == 0:
        lk.send("w", WEIGHTS)
        _STATE["ok"] = True
    else:
        _STATE["ok"] = bool(torch.equal(lk.recv("w"), WEIGHTS))
    # both ranks done before either ends (a rank that closes first is a lost peer to the other)
    store.set(f"done/{rank}", "1")
    store.wait([f"done/{1 - rank}"], timedelta(seconds=30))
    if ending == "exit":
        sys.exit(0)  # node and link never closed
    with node:
        _end(ending, node)


def dist(ending: str) -> None:
    import torch.distributed as d

    d.init_process_group("tensorwire")
    rank = d.get_rank()
    t = WEIGHTS.clone() if rank == 0 else torch.zeros_like(WEIGHTS)
    if rank == 0:
        d.send(t, 1)
        _STATE["ok"] = True
    else:
        d.recv(t, 0)
        _STATE["ok"] = bool(torch.equal(t, WEIGHTS))
    d.barrier()
    if ending == "exit":
        sys.exit(0)  # no destroy_process_group, as many scripts do
    d.destroy_process_group()
    _end(ending, None)


def main(argv: list[str]) -> None:
    scenario, ending, *args = argv
    if ending not in ("close", "exit", "raise"):
        raise SystemExit(f"unknown ending {ending!r}")
    if scenario == "client":
        client(ending, args[0])
    elif scenario == "link":
        link(ending, int(args[0]), int(args[1]), args[2])
    elif scenario == "dist":
        dist(ending)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
