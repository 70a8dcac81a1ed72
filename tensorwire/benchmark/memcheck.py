"""The Link allocates nothing after its first steps: 1,000 steps of a 1 MiB exchange, measured three ways.

Rank 0 sends 1 MiB and receives 1 MiB back each step; rank 1 echoes what it
received (straight out of its receive slot). After steps 1 and 2 (the first message
into each of the two receive slots pays its one-off costs) each rank records

- RSS (``/proc/self/statm``) and, after ``steps`` more steps, its growth, and the
  growth in the second half of those steps alone (a per-step leak shows there; a
  one-off, e.g. state UCX or CUDA sets up lazily, does not);
- in a second run of ``steps`` steps under ``tracemalloc``, the Python memory
  still allocated at the end that was allocated during those steps, and how
  much of it appeared in the second half (a per-step leak grows there; a
  one-off cache filled on first use does not);
- every slot's ``data_ptr`` (must not change) and the set of buffers
  ``recv`` returned (must be the link's own slots: two, double-buffered).

Run with ``transport="auto"`` this also shows which transport auto picks.
"""

from __future__ import annotations

import gc
import os
import traceback
import tracemalloc
from typing import Any, Callable

from tensorwire.benchmark.worker import finish, pick_device

__all__ = ["entry", "RSS_TOLERANCE", "TRACED_TOLERANCE"]

#: Growth tolerated as noise (interpreter free lists, a late page of a thread stack): far below one message.
RSS_TOLERANCE = 64 * 1024
#: A one-off RSS increase tolerated in the first half (measured: +1.2 MB with UCX on CUDA memory,
#: the same after 300, 1,000 or 3,000 steps -- cuda_ipc/CUDA state set up lazily, not a leak).
ONE_OFF_LIMIT = 4 * 1024 * 1024
TRACED_TOLERANCE = 4 * 1024
#: Python memory allowed to appear during the second half of the traced steps: a per-step leak of even one
#: small object (>= 16 B) would add >= 8 KiB over 500 steps; one-off cache fills are a few hundred bytes.
SLOPE_TOLERANCE = 2048


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def entry(
    name: str, rank: int, cfg_dict: dict[str, Any], store_host: str, store_port: int, prefix: str, q: Any
) -> None:
    """``name`` is ``memcheck-<transport>``; same reporting protocol as :func:`tensorwire.benchmark.worker.entry`."""
    item: tuple
    try:
        from datetime import timedelta

        import torch
        from torch.distributed import TCPStore

        from tensorwire.p2p.node import Node
        from tensorwire.spec import TensorSpec
        from tensorwire.benchmark.config import BenchConfig

        torch.set_num_threads(1)
        cfg = BenchConfig.from_dict(cfg_dict)
        device = pick_device(cfg, rank)
        transport = name.split("-", 1)[1]
        store = TCPStore(store_host, store_port, 2, False, timedelta(seconds=cfg.op_timeout))
        node = Node(
            rank=rank,
            world_size=2,
            store=store,
            host=cfg.host,
            transport=transport,  # type: ignore[arg-type]
            timeout=cfg.op_timeout,
            prefix=prefix,
            device=device if device.type == "cuda" else None,
        )
        try:
            a = TensorSpec("a", (cfg.memcheck_size,), "uint8", device.type)
            b = a.with_name("b")
            link = node.link(1 - rank, send=[a] if rank == 0 else [b], recv=[b] if rank == 0 else [a], name="memcheck")
            src = torch.full((cfg.memcheck_size,), 7, dtype=torch.uint8, device=device)
            seen: set[int] = set()

            def step() -> None:
                if rank == 0:
                    link.send("a", src)
                    got = link.recv("b")
                else:
                    got = link.recv("a")
                    link.send("b", got)
                p = got.data_ptr()
                if p not in seen:
                    seen.add(p)

            # Two steps first: receive slots are double-buffered, and the first message into each
            # one pays its one-off costs (UCX registration, CUDA IPC mapping of the peer's buffer).
            step()
            step()
            gc.collect()
            slots0 = [s.data_ptr for s in link.slots()]
            rss0 = _rss()
            n = cfg.memcheck_steps - 2
            for _ in range(n // 2):
                step()
            gc.collect()
            rss_mid = _rss()
            for _ in range(n - n // 2):
                step()
            gc.collect()
            rss1 = _rss()
            rss_growth = rss1 - rss0
            rss_second_half = rss1 - rss_mid
            tracemalloc.start()
            base, _ = tracemalloc.get_traced_memory()
            half = cfg.memcheck_steps // 2
            for _ in range(half):
                step()
            gc.collect()
            mid, _ = tracemalloc.get_traced_memory()
            for _ in range(cfg.memcheck_steps - half):
                step()
            gc.collect()
            cur, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            slots1 = [s.data_ptr for s in link.slots()]
            traced = cur - base
            stable = slots0 == slots1
            in_slots = seen <= set(slots1)
            # Per-step growth is what must be zero: the second half of the run must not grow RSS
            # (a one-off, e.g. UCX/CUDA pools filled on first use, shows in the first half only, and
            # is bounded by ONE_OFF_LIMIT), and the Python heap must not grow either.
            ok = (
                rss_second_half <= RSS_TOLERANCE
                and rss_growth <= ONE_OFF_LIMIT
                and traced <= TRACED_TOLERANCE
                and cur - mid <= SLOPE_TOLERANCE
                and stable
                and in_slots
            )
            item = (
                "result",
                rank,
                {
                    "transport": link.transport,
                    "rss_growth": rss_growth,
                    "rss_second_half": rss_second_half,
                    "traced_growth": traced,
                    "traced_second_half": cur - mid,
                    "traced_peak": peak - base,
                    "slots_stable": stable,
                    "recv_buffers": len(seen),
                    "recv_in_slots": in_slots,
                    "verdict": "PASS" if ok else "FAIL",
                },
            )
            link.close()
        finally:
            node.close()
    except BaseException as exc:  # noqa: BLE001 - reported to the runner
        item = ("error", rank, type(exc).__name__, str(exc) or repr(exc), traceback.format_exc())
    try:
        finish(q, item)
    finally:
        os._exit(0)


def run(cfg: Any, transports: list[str], *, run_pair: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """One memcheck pair per transport (``auto`` first), each run by ``run_pair`` (the runner's); results in
    report form."""
    out = []
    for t in transports:
        res = run_pair(f"memcheck-{t}", cfg, target=entry, timeout=120.0 + cfg.memcheck_steps * 0.05)
        item: dict[str, Any] = {
            "transport_asked": t,
            "status": res["status"],
            "size": cfg.memcheck_size,
            "steps": cfg.memcheck_steps,
        }
        if res["status"] == "ok":
            item["ranks"] = {"0": res["sender"], "1": res["receiver"]}
            item["transport"] = res["sender"]["transport"]
            item["verdict"] = "PASS" if all(r["verdict"] == "PASS" for r in item["ranks"].values()) else "FAIL"
        else:
            item["error"] = res.get("error", "")
        out.append(item)
    return out
