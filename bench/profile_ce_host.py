#!/usr/bin/env python
"""Where the host time of a CUDA ``isend``/``irecv`` on the copy-engine path goes (rank 0 under cProfile).

::

    torchrun --standalone --nproc-per-node 2 bench/profile_ce_host.py [--bytes 65536] [--iters 2000]

A ``dist.send``/``dist.recv`` ping-pong; rank 0 prints its host time per call without the profiler, then
the functions that took the most time under it. Before that (``--pieces``, default on) rank 0 times each piece
of a message alone, in a loop on its own stream: torch's dispatch into a Python ProcessGroup that does nothing,
the signature, a Work, the current stream, each driver call the path makes, the region's lock -- the budget
a message's host time is made of.

``--ab TURNS --no-pieces``: only the ping-pong's one-way time, the path with one change switched off against the
path as it is, in turns within the run (``--ab-change`` says which; see ``_ab``), with the time Python's cycle
collector took in each.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import statistics
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

import tensorwire  # noqa: F401  (registers the backend)
from tensorwire.transport.ce.watched import PRUNE_AT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--no-pieces", dest="pieces", action="store_false", help="skip timing each piece alone")
    ap.add_argument(
        "--levels",
        action="store_true",
        help="the same ping-pong entered at each layer of the path in turns (torch's dist call, the backend, "
        "the copy-engine module, the pair) -- what each layer adds",
    )
    ap.add_argument(
        "--driver-times",
        action="store_true",
        help="after the split, one more with each driver call counted and timed inside the messages",
    )
    ap.add_argument(
        "--copy-call",
        choices=("generic", "dtod"),
        default="generic",
        help="the driver call of the path's copies: cuMemcpyAsync (the path's) or cuMemcpyDtoDAsync",
    )
    ap.add_argument(
        "--ab",
        type=int,
        default=0,
        metavar="TURNS",
        help="only this: the dist.send/recv ping-pong in TURNS turns of each variant (ABBA order): the path with "
        "the change --ab-change names switched off ('before') against the path as it is ('after'); prints one-way "
        "times, their ratio and the cycle collector's share",
    )
    ap.add_argument(
        "--ab-change",
        choices=(
            "prune",
            "capture-lock",
            "bindings",
            "inline-wait",
            "inline-host-wait",
            "push-wait",
            "push-wait-inline",
            "lookups",
        ),
        default=None,
        help="what --ab switches off (default prune): 'prune', the callers completing and dropping completed "
        "messages themselves (before: only the watchdog's look every 50 ms does); 'capture-lock', the two cuts of "
        "f7b3f2a (before: every call asks the driver whether the stream is captured; a lock found taken is slept "
        "for at once); 'bindings', the per-message driver calls through cuda-python's bindings (before: through "
        "ctypes; needs cuda-bindings installed for the driver's CUDA major); 'inline-wait', a second side whose peer "
        "has not reached its call yet copying on the caller's stream after a wait for the peer there, copies of up "
        "to --bytes inline (before: such a copy goes on an internal stream ordered by an event); 'inline-host-wait', "
        "such a side waiting on the host (up to 50 us) for its peer's flag instead, then copying on the caller's "
        "stream; 'push-wait', a send of more than TENSORWIRE_CE_INLINE_MAX waiting on the host for its receive so "
        "that its own GPU pushes (before: TENSORWIRE_CE_PUSH_WAIT_US=0, whichever side comes second copies); "
        "'push-wait-inline', the same, and before also copies of up to --bytes on the caller's stream; 'lookups', "
        "the group's rank() answered in Python and torch's raw-stream function looked up once (before: pybind11's "
        "rank(), and an import and a lookup of the function per call)",
    )
    ap.add_argument(
        "--ab-inline-kib",
        type=int,
        default=0,
        metavar="KIB",
        help="with --ab: compare instead, between two processes of one GPU, the copies above 4 MiB waiting for "
        "their peer on the host ('before': the rule until 2026-11-30) with those above KIB doing so ('after')",
    )
    args = ap.parse_args()
    if args.bytes < 4 or args.iters < 1 or args.ab < 0 or args.ab_inline_kib < 0:
        ap.error("--bytes >= 4, --iters >= 1, --ab >= 0, --ab-inline-kib >= 0")
    if (args.ab_inline_kib or args.ab_change) and not args.ab:
        ap.error("--ab-inline-kib and --ab-change choose what --ab compares: give --ab TURNS too")
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if args.pieces:
        _register_nothing()
    if args.copy_call == "dtod":
        from tensorwire.transport.ce import CeDriver

        CeDriver.get()._memcpy = _memcpy_dtod()  # (the path's copy() calls whatever _memcpy is)
    dist.init_process_group("tensorwire")
    t = torch.ones(args.bytes // 4, device=device)
    if args.pieces:
        nothing = dist.new_group(backend="twnothing")
        if rank == 0:
            for name, us in _pieces(torch, dist, nothing, t, device):
                print(f"piece {name:<44s} {us:7.2f} us")
        dist.barrier()

    issued = [0.0]

    def loop(n: int) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        issued[0] = (time.perf_counter() - t0) / (2 * n)  # (the host's part: its calls returned)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (2 * n)

    if args.ab:
        _ab(rank, loop, args.ab, args.iters, args.ab_inline_kib, args.ab_change or "prune", args.bytes)
        dist.destroy_process_group()
        return

    def split(n: int, clock: object = time.perf_counter) -> list[float]:
        """Host time inside isend, its wait, irecv, its wait (rank 0's order), microseconds per call."""
        acc = [0.0] * 4
        each: list[list[float]] = [[], [], [], []]
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(n):
            peer = 1 - rank
            calls = ((dist.isend, 0), (dist.irecv, 2)) if rank == 0 else ((dist.irecv, 2), (dist.isend, 0))
            for call, k in calls:
                t0 = clock()  # type: ignore[operator]
                w = call(t, peer)
                t1 = clock()  # type: ignore[operator]
                w.wait()
                t2 = clock()  # type: ignore[operator]
                acc[k] += t1 - t0
                acc[k + 1] += t2 - t1
                each[k].append(t1 - t0)
                each[k + 1].append(t2 - t1)
        torch.cuda.synchronize()
        spread.clear()
        for xs in each:  # (median, 99th percentile, max, and the calls over 1 ms: what makes a mean)
            xs.sort()
            spread.append((xs[len(xs) // 2], xs[len(xs) * 99 // 100], xs[-1], sum(x > 1e-3 for x in xs)))
        return [a / n * 1e6 for a in acc]

    spread: list[tuple[float, float, float, int]] = []

    loop(50)
    if args.levels:
        got = _levels(rank, t, device, args.iters)
        for turn in range(2):
            dist.barrier()
            if turn == rank:
                for name, (us_send, us_recv) in got.items():
                    print(
                        f"rank {rank}: level {name:<32s} send + wait {us_send:6.1f} us, recv + wait {us_recv:6.1f} us "
                        "(median message)",
                        flush=True,
                    )
    pair = _pair_of(1 - rank)
    region = pair.region if pair is not None else None  # type: ignore[attr-defined]
    full0 = region.full_waits if region is not None else 0
    plain = loop(args.iters)
    plain_issued = issued[0]
    full = region.full_waits - full0 if region is not None else "?"
    lock = region.mutex if region is not None else None

    def lock_counts() -> tuple[int, int, int]:
        return (lock.contended, lock.slept, lock.wait_ns) if lock is not None else (0, 0, 0)

    lock0 = lock_counts()
    parts = split(args.iters)
    parts_spread = list(spread)
    lock_parts = [b - a for a, b in zip(lock0, lock_counts())] if lock is not None else None
    # the same calls by the thread's CPU clock: where it is well below the wall clock, the thread was not running
    # (waiting for the GIL, or asleep in the driver) for the difference
    cpu_parts = split(args.iters, time.thread_time)
    calls = _time_driver() if args.driver_times else None
    if calls is not None:
        split(args.iters)
        driver = {
            k: (len(v) / (2 * args.iters), statistics.median(v) / 1e3, sum(v) / len(v) / 1e3, max(v) / 1e3)
            for k, v in calls.items()
            if v
        }
    counts = list(pair.counts) if pair is not None else None  # type: ignore[attr-defined]
    prof = cProfile.Profile()
    prof.enable()
    profiled = loop(args.iters)
    prof.disable()
    # each rank reports in turn (the one that waits in a ping-pong is the one whose host is not the limit)
    for turn in range(2):
        dist.barrier()
        if turn != rank:
            continue
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        order = "isend first" if rank == 0 else "irecv first"
        print(
            f"rank {rank} ({order}): host time per call: isend {parts[0]:.1f} us, its wait {parts[1]:.1f}; "
            f"irecv {parts[2]:.1f}, its wait {parts[3]:.1f}"
        )
        for name, (med, p99, worst, slow) in zip(("isend", "its wait", "irecv", "its wait"), parts_spread):
            print(
                f"rank {rank}: {name:<9s} per call: median {med * 1e6:7.1f} us, p99 {p99 * 1e6:8.1f}, max "
                f"{worst * 1e6:9.1f}; {slow} calls over 1 ms"
            )
        print(f"rank {rank}: threads: {', '.join(sorted(th.name for th in threading.enumerate()))}")
        print(
            f"rank {rank}: the same by the thread's CPU clock: isend {cpu_parts[0]:.1f} us, its wait "
            f"{cpu_parts[1]:.1f}; irecv {cpu_parts[2]:.1f}, its wait {cpu_parts[3]:.1f}"
        )
        if lock_parts is not None:
            found, slept, ns = lock_parts
            print(
                f"rank {rank}: the pair's lock in those calls: found taken {found} times in {2 * args.iters} "
                f"isend/irecv, slept for {slept}; {ns / 1e3 / (2 * args.iters):.2f} us per call waiting for it "
                f"(spin budget {lock.spin_ns / 1e3:.0f} us)"
            )
        if calls is not None:
            for name, (per_call, med, mean, worst) in sorted(driver.items()):
                print(
                    f"rank {rank}: driver {name:<12s} {per_call:5.2f} per isend/irecv, us per call: median {med:6.2f}, "
                    f"mean {mean:6.2f}, max {worst:8.1f}"
                )
        print(f"rank {rank}: one-way {plain * 1e6:.1f} us per message ({profiled * 1e6:.1f} us under the profiler)")
        print(
            f"rank {rank}: of it the host's calls {plain_issued * 1e6:.1f} us per message (then the GPU's tail); "
            f"{full} waits for a free entry in {2 * args.iters} messages"
        )
        if counts is not None:
            first, inline, queued = counts[:3]
            print(
                f"rank {rank}'s part in its messages: first {first}, second with the copy on the caller's stream "
                f"{inline}, second with the copy on an internal stream {queued} (copy call: {args.copy_call})"
            )
        print(out.getvalue(), flush=True)
    dist.destroy_process_group()


def _levels(rank: int, t: object, device: object, iters: int) -> dict[str, tuple[float, float]]:
    """Median host us of (send + its wait) and (recv + its wait) when the ping-pong enters at each layer."""
    from tensorwire.distributed import copyengine
    from tensorwire.distributed.signatures import signature_of

    peer = 1 - rank
    backend = dist.group.WORLD._get_backend(device)
    p = backend._peers[peer]
    pair = p.ce
    dev = device.index  # type: ignore[attr-defined]
    sig, words = signature_of(t)  # type: ignore[arg-type]
    raw = torch._C._cuda_getCurrentRawStream

    def what() -> str:
        return "message"

    def pair_send() -> None:
        s = raw(dev)
        pair.order_after(pair.send(t, 1, words, sig.nbytes, s, dev, what), s, dev)

    def pair_recv() -> None:
        s = raw(dev)
        pair.order_after(pair.recv(t, 1, words, sig.nbytes, s, dev, what), s, dev)

    levels = {
        "torch: dist.isend/irecv + wait": (
            lambda: dist.isend(t, peer).wait(),  # type: ignore[arg-type]
            lambda: dist.irecv(t, peer).wait(),  # type: ignore[arg-type]
        ),
        "backend: pg.send/recv + wait": (
            lambda: backend.send([t], peer, 0).wait(),
            lambda: backend.recv([t], peer, 0).wait(),
        ),
        "copyengine.isend/irecv + wait": (
            lambda: copyengine.isend(p, pair, t, 0).wait(),  # type: ignore[arg-type]
            lambda: copyengine.irecv(p, pair, t, 0).wait(),  # type: ignore[arg-type]
        ),
        "pair.send/recv + order_after": (pair_send, pair_recv),
    }
    times: dict[str, tuple[list[int], list[int]]] = {k: ([], []) for k in levels}
    clock = time.perf_counter_ns
    for _turn in range(4):
        for name, (send, recv) in levels.items():
            torch.cuda.synchronize()
            dist.barrier()
            sends, recvs = times[name]
            for _ in range(max(1, iters // 4)):
                for fn, acc in ((send, sends), (recv, recvs)) if rank == 0 else ((recv, recvs), (send, sends)):
                    t0 = clock()
                    fn()
                    acc.append(clock() - t0)
    torch.cuda.synchronize()
    return {k: (statistics.median(a) / 1e3, statistics.median(b) / 1e3) for k, (a, b) in times.items()}


def _time_driver() -> dict[str, list[int]]:
    """Wrap the path's driver calls to record each call's wall time in ns (the wrapper adds ~0.2 us each)."""
    from tensorwire.transport.ce import CeDriver

    d = CeDriver.get()
    acc: dict[str, list[int]] = {}
    clock = time.perf_counter_ns
    for name in ("context", "capturing", "allocation", "copy", "write", "wait", "order", "copy_tensor"):
        fn = getattr(d, name)
        times = acc[name] = []

        def timed(*a: object, _fn: object = fn, _times: list[int] = times) -> object:
            t0 = clock()
            try:
                return _fn(*a)  # type: ignore[operator]
            finally:
                _times.append(clock() - t0)

        setattr(d, name, timed)
    return acc


def _memcpy_dtod() -> object:
    """``cuMemcpyDtoDAsync`` with the argument types of the path's ``cuMemcpyAsync`` (the driver module's helpers)."""
    import ctypes

    from tensorwire.transport.ce.driver import _fn, _lib

    c = ctypes
    return _fn(_lib(), ("cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"), [c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p])


def _ab(
    rank: int,
    loop: Callable[[int], float],
    turns: int,
    iters: int,
    inline_kib: int = 0,
    change: str = "prune",
    nbytes: int = 0,
) -> None:
    """``--ab``: one-way time of the ``dist.send``/``dist.recv`` ping-pong (``loop``: seconds per message) with
    ``change`` switched off ("before") and as it is ("after"), in turns (ABBA; both ranks switch at the same turn:
    no message needed to agree), and the cycle collector's runs and time in each. With ``inline_kib``: between
    two processes of one GPU, copies above 4 MiB waiting for their peer on the host against copies above that
    many KiB doing so."""
    import ctypes

    def one_way(n: int) -> float:
        return loop(n) * 1e6

    one_way(50)  # (the pair is made by the first message)
    pair = _pair_of(1 - rank)
    if pair is None:
        raise SystemExit("--ab: no copy-engine pair with the peer (CUDA tensors do not take the copy-engine path)")
    drv, lock = pair.driver, pair.region.mutex  # type: ignore[attr-defined]
    inline_max = pair.inline_max  # type: ignore[attr-defined]
    push_wait = pair.push_wait_s  # type: ignore[attr-defined]
    spin = lock.spin_ns

    def ask(stream: int) -> bool:  # (the call as it was: the driver is asked for every stream, 0 included)
        status = ctypes.c_int()
        drv._check(drv._is_capturing(stream, ctypes.byref(status)), "cuStreamIsCapturing")
        return status.value != 0

    if change == "bindings" and not inline_kib:
        if not drv.use_bindings(True):
            raise SystemExit(f"--ab-change bindings: cuda-python's bindings are not usable here ({drv.bindings})")
        print(f"ab rank {rank}: before = ctypes, after = {drv.bindings}")

    def variant(before: bool) -> None:
        if inline_kib:
            pair.one_gpu_wait_min = (4 << 20) if before else inline_kib << 10  # type: ignore[attr-defined]
        elif change == "prune":
            pair._prune_at = (1 << 40) if before else PRUNE_AT  # type: ignore[attr-defined]
        elif change == "bindings":
            drv.use_bindings(not before)
        elif change == "lookups":
            _lookups(before)
        elif change in ("push-wait", "push-wait-inline"):
            pair.push_wait_s = 0.0 if before else push_wait  # type: ignore[attr-defined]
            if change == "push-wait-inline":  # (before: whoever comes second copies, on the caller's stream)
                pair.inline_max = max(inline_max, nbytes) if before else inline_max  # type: ignore[attr-defined]
        elif change in ("inline-wait", "inline-host-wait"):  # (after: copies of up to --bytes inline)
            pair.inline_max = inline_max if before else max(inline_max, nbytes)  # type: ignore[attr-defined]
            if change == "inline-wait":
                pair.wait_inline = not before  # type: ignore[attr-defined]
            else:
                pair.inline_host_wait_s = 0.0 if before else 50e-6  # type: ignore[attr-defined]
        elif before:
            drv.capturing = ask
            lock.spin_ns = 0
        else:
            drv.__dict__.pop("capturing", None)
            lock.spin_ns = spin

    got: dict[str, list[float]] = {"before": [], "after": []}
    gcs = {"before": _GcClock(), "after": _GcClock()}
    parts = {"before": [0, 0, 0], "after": [0, 0, 0]}
    for turn in range(2 * turns):
        before = turn % 4 in (0, 3)  # ABBA
        name = "before" if before else "after"
        variant(before)
        one_way(20)  # (settle into the variant)
        c0 = list(pair.counts[:3])  # type: ignore[attr-defined]
        with gcs[name]:
            got[name].append(one_way(iters))
        parts[name] = [p + b - a for p, a, b in zip(parts[name], c0, pair.counts[:3])]  # type: ignore[attr-defined]
    variant(False)
    if rank == 0:
        b, a = statistics.median(got["before"]), statistics.median(got["after"])
        for name, xs in got.items():
            print(f"ab {name:<7s} one-way us per message, {len(xs)} turns: " + " ".join(f"{x:.1f}" for x in xs))
        print(f"ab median one-way: before {b:.1f} us, after {a:.1f} us: after / before {a / b:.3f}")
    for name, clock in gcs.items():
        print(f"ab {name:<7s} rank {rank}: cycle collector {clock.describe()}")
    for name, (first, inline, queued) in parts.items():
        print(
            f"ab {name:<7s} rank {rank}'s part in its messages: first {first}, second with the copy on the caller's "
            f"stream {inline}, second with the copy on an internal stream {queued}"
        )


def _lookups(before: bool) -> None:
    """``--ab-change lookups``: the two lookups of a message as they were (``before``) or as they are."""
    import tensorwire.cuda as twcuda
    from tensorwire.distributed.process_group import ProcessGroupTensorwire as PG

    if not hasattr(_lookups, "saved"):
        _lookups.saved = (PG.__dict__["rank"], PG.__dict__["size"], twcuda._raw_stream_fn())  # type: ignore[attr-defined]
    rank, size, fn = _lookups.saved  # type: ignore[attr-defined]
    if before:
        for name in ("rank", "size"):  # (torch's then, through pybind11)
            if name in PG.__dict__:
                delattr(PG, name)

        def each_time(device: int) -> int:
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            return int(raw(device))

        twcuda._RAW_STREAM[0] = each_time
    else:
        PG.rank, PG.size = rank, size
        twcuda._RAW_STREAM[0] = fn


class _GcClock:
    """Runs of Python's cycle collector by generation, and their time, while inside ``with`` (gc.callbacks)."""

    def __init__(self) -> None:
        self.runs = [0, 0, 0]
        self.ns = [0, 0, 0]
        self.longest_ns = 0
        self._t0 = 0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            g, dt = info["generation"], time.perf_counter_ns() - self._t0
            self.runs[g] += 1
            self.ns[g] += dt
            self.longest_ns = max(self.longest_ns, dt)

    def __enter__(self) -> None:
        gc.callbacks.append(self._cb)

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)

    def describe(self) -> str:
        gens = ", ".join(f"gen{g} {n} runs {ns / 1e6:.1f} ms" for g, (n, ns) in enumerate(zip(self.runs, self.ns)))
        return f"{gens}; the longest run {self.longest_ns / 1e6:.2f} ms"


def _pair_of(peer: int) -> object:
    """This rank's copy-engine pair with ``peer`` in the default group (None where CUDA tensors take UCX)."""
    import torch
    import torch.distributed as dist

    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda", torch.cuda.current_device()))
    except RuntimeError:
        return None
    p = getattr(backend, "_peers", {}).get(peer)
    return getattr(p, "ce", None)


def _register_nothing() -> None:
    """A ProcessGroup whose send/recv return a finished Work at once: what torch's dispatch alone costs."""

    class _Done(dist.Work):
        def wait(self, timeout: object = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    def make(store: object, rank: int, size: int, timeout: object) -> dist.ProcessGroup:
        class _Nothing(dist.ProcessGroup):
            def __init__(self) -> None:
                super().__init__(rank, size)

            def send(self, tensors: object, dst: int, tag: int) -> dist.Work:
                return _Done()

            def recv(self, tensors: object, src: int, tag: int) -> dist.Work:
                return _Done()

            def getBackendName(self) -> str:
                return "twnothing"

        return _Nothing()

    dist.Backend.register_backend("twnothing", make, devices=["cpu", "cuda"])


def _pieces(torch: object, dist: object, nothing: object, t: object, device: object) -> list[tuple[str, float]]:
    """Host time of each piece alone (microseconds per call; stream work drained every 200 calls, untimed)."""
    import ctypes
    import mmap

    from tensorwire.distributed.signatures import signature_of
    from tensorwire.distributed.work import Work
    from tensorwire.transport.ce import CeDriver
    from tensorwire.transport.ce.region import Region

    d = CeDriver.get()
    idx = device.index
    d.context(idx)
    s, s2, ev = d.new_stream(), d.new_stream(), d.new_event()
    host = mmap.mmap(-1, 1 << 16)
    haddr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    dev = d.register_host(haddr, 1 << 16)
    a = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    b = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    region = Region.create()
    raw = torch._C._cuda_getCurrentRawStream
    out = []

    def timed(name: str, fn: object, stream_work: bool = False) -> None:
        total, n = 0.0, 0
        for batch in range(21):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            dt = time.perf_counter() - t0
            if stream_work:
                torch.cuda.synchronize(device)
                d.context(idx)
            if batch:  # (the first batch warms up)
                total, n = total + dt, n + 200
        out.append((name, total / n * 1e6))

    timed("dist.isend into a do-nothing Python group", lambda: dist.isend(t, 1, group=nothing))
    timed("dist.isend(...).wait() into it", lambda: dist.isend(t, 1, group=nothing).wait())
    timed("signature_of(tensor)", lambda: signature_of(t))
    timed("Work(...) (tensorwire's base)", lambda: Work(10.0, [t]))
    timed("current raw stream", lambda: raw(idx))
    timed("tensor.data_ptr() + is_contiguous()", lambda: (t.data_ptr(), t.is_contiguous()))
    timed("driver.context (cached)", lambda: d.context(idx))
    timed("cuStreamIsCapturing", lambda: d.capturing(s))
    timed("cuPointerGetAttributes (allocation)", lambda: d.allocation(a.data_ptr()))
    timed("region mutex lock + unlock", lambda: region.mutex.__enter__() or region.mutex.__exit__())
    timed("cuStreamWriteValue32", lambda: d.write(s, dev, 1), True)
    timed("cuStreamWaitValue32 (already reached)", lambda: d.wait(s, dev, 0), True)
    timed("cuEventRecord + cuStreamWaitEvent", lambda: d.order(s2, s, ev), True)
    timed("cuMemcpyAsync 64 KiB (device-local)", lambda: d.copy(s, a.data_ptr(), b.data_ptr(), 65536), True)
    timed("cuMemcpyAsync 1 MiB (device-local)", lambda: d.copy(s, a.data_ptr(), b.data_ptr(), 1 << 20), True)
    dtod = _memcpy_dtod()
    timed("cuMemcpyDtoDAsync 64 KiB (device-local)", lambda: dtod(a.data_ptr(), b.data_ptr(), 65536, s), True)
    timed("cuMemcpyDtoDAsync 1 MiB (device-local)", lambda: dtod(a.data_ptr(), b.data_ptr(), 1 << 20, s), True)
    # the same copy through other bindings, and torch's own calls: is a driver call's cost ctypes or the driver?
    with torch.cuda.stream(torch.cuda.ExternalStream(s, device=device)):
        timed("torch b.copy_(a) 1 MiB (device-local)", lambda: b.copy_(a), True)
        timed("torch a.fill_(1) (one kernel launch)", lambda: a.fill_(1), True)
    try:
        from cuda.bindings import driver as cb  # (cuda-python's Cython bindings, where installed)
    except ImportError:
        out.append(("cuda.bindings cuMemcpyAsync (not installed)", float("nan")))
    else:
        cs = cb.CUstream(s)
        timed(
            "cuda.bindings cuMemcpyAsync 1 MiB", lambda: cb.cuMemcpyAsync(a.data_ptr(), b.data_ptr(), 1 << 20, cs), True
        )
        timed("cuda.bindings cuStreamWriteValue32", lambda: cb.cuStreamWriteValue32(cs, dev, 1, 0), True)
    timed(
        "write + wait + copy 64 KiB + write",
        lambda: (
            d.write(s, dev, 1),
            d.wait(s, dev, 0),
            d.copy(s, a.data_ptr(), b.data_ptr(), 65536),
            d.write(s, dev + 4, 1),
        ),
        True,
    )
    torch.cuda.synchronize(device)
    region.close()
    d.unregister_host(haddr)
    return out


if __name__ == "__main__":
    main()
