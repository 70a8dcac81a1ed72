"""What each process of a benchmark pair runs: the timing driver (rank 0), the sink (rank 1), ``--check``.

Message content: a deterministic pseudo-random pattern per size (the same on
both sides), with the message's sequence number stamped into its first and
last 8 bytes, so ``--check`` catches corrupted bytes *and* stale or reordered
messages. Stamping and checking happen only with ``--check``; then the
timings include them (use ``--check`` for correctness, not for figures).
"""

from __future__ import annotations

import os
import resource
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.benchmark.backends.base import BackendUnavailable, PairContext
from tensorwire.benchmark.config import BenchConfig, Steps

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.benchmark.backends.base import Sender

__all__ = ["CheckError", "Sink", "pattern", "entry", "run_sender", "pair_process_setup"]

STAMP = 8
#: Sequence number (per size, counting every message) whose payload ``--inject-corruption`` flips.
CORRUPT_SEQ = 2


class CheckError(AssertionError):
    """A received buffer is not bit-exact what was sent."""


def pattern(size: int, device: "torch.device") -> "torch.Tensor":
    """The deterministic content of every message of ``size`` bytes (before stamping)."""
    import torch

    g = torch.Generator().manual_seed(0x7E5 + size)
    t = torch.empty(size, dtype=torch.uint8).random_(0, 256, generator=g)
    return t.to(device) if device.type != "cpu" else t


def _stamp_bytes(seq: int, device: "torch.device") -> "torch.Tensor":
    import torch

    return torch.tensor(list(seq.to_bytes(STAMP, "little")), dtype=torch.uint8, device=device)


def usage() -> tuple[int, float]:
    """(voluntary context switches, CPU seconds) of this process, all threads.

    A voluntary switch is a thread going to sleep, so one wake-up; CPU time is
    what a round trip costs the machine, which stays meaningful when others load the cores.
    """
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_nvcsw, ru.ru_utime + ru.ru_stime


class Stamper:
    """Prepares ``src`` before each send: stamps the sequence number, injects corruption if asked."""

    def __init__(self, src: "torch.Tensor", *, check: bool, corrupt: bool) -> None:
        self.src = src
        self.check = check
        self.corrupt = corrupt
        self.seq = 0
        self.flipped = False

    def __call__(self) -> None:
        src = self.src
        if self.flipped:
            src[len(src) // 2] ^= 0xFF
            self.flipped = False
        if self.check:
            stamp = _stamp_bytes(self.seq, src.device)
            src[:STAMP] = stamp
            src[-STAMP:] = stamp
        if self.corrupt and self.seq == CORRUPT_SEQ:
            src[len(src) // 2] ^= 0xFF
            self.flipped = True
        self.seq += 1

    def noop(self) -> None:
        self.seq += 1


class Sink:
    """Rank 1's end of every message: counts, checks (``--check``), samples context switches."""

    def __init__(self, cfg: BenchConfig, steps: list[Steps], device: "torch.device") -> None:
        self.check = cfg.check
        self.device = device
        self.counts: dict[int, int] = {}
        self.expected: dict[int, "torch.Tensor"] = {}
        self.total = 0
        self.seen = 0
        # message index window of each size's timed round trips: [start, end]
        self.rtt_window: dict[int, tuple[int, int]] = {}
        for st in steps:
            n = 1 + st.warmup
            for p in cfg.patterns:
                if p == "rtt":
                    self.rtt_window[st.size] = (n, n + st.rtt_iters - 1)
                n += st.messages(p)
            self.total += n
        self.usage: dict[int, list[tuple[int, float]]] = {}

    def prepare(self, size: int) -> None:
        """Build the expected content for ``size`` before its first message (keeps it off the timed path)."""
        if self.check and size not in self.expected:
            self.expected.clear()
            self.expected[size] = pattern(size, self.device)

    def got(self, size: int, t: "torch.Tensor") -> None:
        k = self.counts.get(size, 0)
        if self.check:
            self.prepare(size)
            self._verify(size, k, t)
        win = self.rtt_window.get(size)
        if win is not None and (k == win[0] or k == win[1]):
            self.usage.setdefault(size, []).append(usage())
        self.counts[size] = k + 1
        self.seen += 1

    def complete(self) -> bool:
        return self.seen >= self.total

    def _verify(self, size: int, seq: int, t: "torch.Tensor") -> None:
        import torch

        want = self.expected[size]
        if t.numel() != size or t.dtype != torch.uint8:
            raise CheckError(f"size {size} message {seq}: got {t.dtype}[{t.numel()}]")
        stamp = _stamp_bytes(seq, t.device)
        ok = (
            torch.equal(t[STAMP:-STAMP], want[STAMP:-STAMP])
            and torch.equal(t[:STAMP], stamp)
            and torch.equal(t[-STAMP:], stamp)
        )
        if ok:
            return
        full = want.clone()
        full[:STAMP] = stamp
        full[-STAMP:] = stamp
        diff = (t != full).nonzero().flatten()
        first = int(diff[0])
        raise CheckError(
            f"size {size} message {seq}: {diff.numel()} byte(s) differ, first at offset {first} "
            f"(got {int(t[first]):#04x}, sent {int(full[first]):#04x})"
        )

    def report(self) -> dict[str, Any]:
        switches, cpu = {}, {}
        for size, (a, b) in self.rtt_window.items():
            u = self.usage.get(size, [])
            if len(u) == 2 and b > a:
                switches[str(size)] = (u[1][0] - u[0][0]) / (b - a)
                cpu[str(size)] = (u[1][1] - u[0][1]) / (b - a)
        return {"messages": self.seen, "switches_per_rtt": switches, "cpu_s_per_rtt": cpu}


def run_sender(
    tx: "Sender",
    cfg: BenchConfig,
    steps: list[Steps],
    device: "torch.device",
    progress: Callable[[int, int, str], None],
    *,
    corrupt: bool = False,
) -> dict[str, Any]:
    """Rank 0's driver: for each size, a first transfer on fresh buffers, warm-up, then the patterns."""
    perf = time.perf_counter
    sizes_out = []
    for i, st in enumerate(steps):
        progress(i, len(steps), f"{st.size}")
        if cfg.check or corrupt:
            src = pattern(st.size, device)
        else:  # content is irrelevant to every transport here; skip generating 1 GiB of random bytes
            import torch

            src = torch.full((st.size,), 0xA5, dtype=torch.uint8, device=device)
        stamper = Stamper(src, check=cfg.check, corrupt=corrupt)
        prepare = stamper if (cfg.check or corrupt) else stamper.noop
        tx.open(st.size, src)
        t0 = perf()
        tx.rtt_once(prepare)
        first = perf() - t0
        for _ in range(st.warmup):
            tx.rtt_once(prepare)
        entry: dict[str, Any] = {"size": st.size, "first_s": first, "warmup": st.warmup}
        for p in cfg.patterns:
            if p == "uni":
                reps = []
                for _ in range(st.uni_reps):
                    t0 = perf()
                    tx.run_uni(st.uni_batch, prepare)
                    reps.append(perf() - t0)
                entry["uni"] = {"batch": st.uni_batch, "seconds": reps}
            else:
                times = []
                rtt_once = tx.rtt_once
                sw0, cpu0 = usage()
                for _ in range(st.rtt_iters):
                    t0 = perf()
                    rtt_once(prepare)
                    times.append(perf() - t0)
                sw1, cpu1 = usage()
                entry["rtt"] = {
                    "seconds": times,
                    "switches_per_rtt": (sw1 - sw0) / st.rtt_iters,
                    "cpu_s_per_rtt": (cpu1 - cpu0) / st.rtt_iters,
                }
        tx.close_size()
        del src
        sizes_out.append(entry)
    progress(len(steps), len(steps), "done")
    from tensorwire.benchmark.environment import ucx_env_effective

    return {"sizes": sizes_out, "transport": tx.transport, "ucx_env": ucx_env_effective()}


def recv_slots(path: str) -> int:
    """Receive buffers per message size of a host stream, in ``tensorwire bench`` and ``tensorwire demo`` alike:
    a Link's default depth for ``"tensorwire"`` (the sender runs one message ahead), one buffer for a raw socket
    or gRPC (the next message waits in the kernel's or gRPC's buffers meanwhile). The sender sends every message
    of a round from one tensor. Both stay in the caches of a stream of 1 MiB messages, as a pipeline stage's
    activations, written just before they are sent into a link of default depth, do; a source and a slot per
    message (a round's worth, 32 MiB) streamed a Link at 0.74-0.81x (``bench/probe_stream_sources.py``)."""
    from tensorwire.p2p.link import DEFAULT_DEPTH

    return DEFAULT_DEPTH if path == "tensorwire" else 1


def pair_process_setup() -> None:
    """What every process of a measured pair does first, here and in ``tensorwire demo`` alike: one torch
    thread (two processes share the cores; no intra-op pool fighting the transport)."""
    import torch

    torch.set_num_threads(1)


def pick_device(cfg: BenchConfig, rank: int) -> "torch.device":
    import torch

    if cfg.device == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise BackendUnavailable("--device cuda but no CUDA device is visible")
        dev = torch.device("cuda", rank % n)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def finish(q: Any, item: tuple) -> None:
    q.put(item)
    q.close()
    q.join_thread()


def entry(
    backend: str, rank: int, cfg_dict: dict[str, Any], store_host: str, store_port: int, prefix: str, q: Any
) -> None:
    """Process entry point of one side of a pair. Reports on ``q``; always ends with ``os._exit``.

    Messages: ``("progress", i, n, label)``, then one of ``("result", rank, payload)``,
    ``("skipped", rank, why)``, ``("check", rank, message)``, ``("error", rank, type, message, traceback)``.
    ``os._exit`` skips interpreter teardown, where UCX/gRPC threads have been seen to hang.
    """
    item: tuple
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        from tensorwire.benchmark.backends import load

        pair_process_setup()
        cfg = BenchConfig.from_dict(cfg_dict)
        device = pick_device(cfg, rank)
        store = TCPStore(store_host, store_port, 2, False, timedelta(seconds=cfg.op_timeout))
        ctx = PairContext(rank=rank, cfg=cfg, store=store, prefix=prefix, device=device, backend=backend)
        sender_cls, receiver_cls, arg = load(backend)
        steps = cfg.steps()
        if rank == 0:
            tx = sender_cls(ctx, arg)
            try:
                result = run_sender(
                    tx,
                    cfg,
                    steps,
                    device,
                    lambda i, n, label: q.put(("progress", i, n, label)),
                    corrupt=cfg.inject_corruption == backend,
                )
            finally:
                tx.close()
            item = ("result", rank, result)
        else:
            rx = receiver_cls(ctx, arg)
            sink = Sink(cfg, steps, device)
            orig_open = rx.open

            def open_and_prepare(size: int) -> None:
                sink.prepare(size)
                orig_open(size)

            rx.open = open_and_prepare
            try:
                rx.serve(steps, cfg.patterns, sink)
            finally:
                rx.close()
            item = ("result", rank, sink.report())
    except BackendUnavailable as exc:
        item = ("skipped", rank, str(exc))
    except CheckError as exc:
        item = ("check", rank, str(exc))
    except BaseException as exc:  # noqa: BLE001 - reported to the runner
        item = ("error", rank, type(exc).__name__, str(exc) or repr(exc), traceback.format_exc())
    try:
        finish(q, item)
    finally:
        os._exit(0)
