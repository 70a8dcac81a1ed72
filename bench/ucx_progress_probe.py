"""Measure UCX (ucxx core API) progress modes, and the tensorwire transport, on this machine.

Every mode runs in a fresh pair of processes (multiprocessing "spawn"): a
server that echoes/acks and a client that times. Nothing is shared between
modes, so a progress thread of one mode cannot disturb another. The traffic
pattern is written once (``_server``/``_client``) over a tiny driver API, so
raw ucxx and tensorwire do exactly the same posts, sends and waits.

Modes (raw ucxx unless said otherwise):

  polling         caller-driven: the waiting thread calls worker.progress() in a loop
  blocking        init_blocking_progress_mode + progress_worker_event() (epoll, no spin)
  hybrid          caller-driven: spin worker.progress() for --spin-us with sched_yield()
                  between two polls, then arm the worker and sleep in poll() on its
                  epoll fd -- the loop tensorwire uses
  hybrid-noyield  the same without sched_yield(): the spinner keeps its core for the
                  whole spin even when the peer (or anything else) is waiting for one
  hybrid+credit   hybrid, plus tensorwire's flow control done by hand: the receiver
                  sends a 16-byte credit (own tag) when it posts a buffer, the sender
                  waits for one before each message -- isolates the credit's cost
  hybrid+lazycredit  the same, but credits are held back until the receiver's next send
                  or wait (sent back-to-back with data, as the TCP transport does)
  thread          ucxx progress thread, polling_mode=False (epoll inside the thread);
                  the waiting thread checks request.completed, yielding with sleep(0)
  thread-polling  ucxx progress thread, polling_mode=True (the thread spins)
  tensorwire      the real UcxListener/UcxTransport (credits, headers, locks, torch)

Figures:

  RTT           median round trip of a 4 KiB message (client send + recv, server echo).
                "pre-posted": the server re-posts its receive buffer *before* it
                replies (double buffering), so a credit is never on the critical path.
                "re-post late": one buffer, re-posted *after* the reply: the next
                credit travels on the critical path (an extra one-way trip).
  MiB/s @ N     one-way N bytes followed by an 8-byte ack, repeated; bytes / time
  idle CPU %    CPU used by the client process while it waits 1 s for a message that
                the server sends only after 1 s (100 = one core busy)

Usage::

    python bench/ucx_progress_probe.py                       # all modes, markdown table
    python bench/ucx_progress_probe.py --modes hybrid tensorwire --repeat 3
    python bench/ucx_progress_probe.py --paired-yield --reply-delay-us 30
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import platform
import select
import statistics
import sys
import time

SIZES = [1 << 20, 16 << 20, 128 << 20]
ITERS = {1 << 20: 40, 16 << 20: 8, 128 << 20: 3}
RAW_MODES = ["polling", "blocking", "hybrid", "hybrid-noyield", "hybrid+credit", "hybrid+lazycredit", "thread",
             "thread-polling"]
ALL_MODES = RAW_MODES + ["tensorwire"]
WARMUP = 200


# -- drivers: post / wait_recv / send ---------------------------------------------------------


class _RawDriver:
    """ucxx core API on one endpoint, with the mode's progress/wait strategy."""

    def __init__(self, mode: str, spin_us: float) -> None:
        import numpy as np
        import ucxx._lib.libucxx as u
        from ucxx._lib.arr import Array

        self.np, self.u, self.Array, self.mode = np, u, Array, mode
        self.ctx = u.UCXContext(feature_flags=(u.Feature.TAG, u.Feature.WAKEUP))
        self.worker = u.UCXWorker(self.ctx)
        if mode.startswith("thread"):
            self.worker.start_progress_thread(polling_mode=(mode == "thread-polling"))
        else:
            self.worker.init_blocking_progress_mode()
            self.poller = select.poll()
            self.poller.register(self.worker.epoll_file_descriptor, select.POLLIN)
        self.spin = spin_us / 1e6
        self.yield_ = mode != "hybrid-noyield"
        self.credits = mode in ("hybrid+credit", "hybrid+lazycredit")
        self.lazy = mode == "hybrid+lazycredit"
        self.grants = []
        self.ep = None
        self.posted = collections.defaultdict(collections.deque)
        self.credit_rx = {}
        self.inflight = []

    # connection
    def listen(self, q) -> None:
        eps = []
        self.listener = self.u.UCXListener.create(
            self.worker, 0, lambda cr: eps.append(self.listener.create_endpoint_from_conn_request(cr, True)))
        q.put(self.listener.port)
        while not eps:
            if not self.mode.startswith("thread"):
                self.worker.progress()
            time.sleep(0.0005)
        self.ep = eps[0]

    def connect(self, port: int) -> None:
        self.ep = self.u.UCXEndpoint.create(self.worker, "127.0.0.1", port, True)

    def alloc(self, n: int, fill: int = 0):
        return self.np.full(n, fill, dtype=self.np.uint8)

    # waiting
    def wait(self, reqs) -> None:
        w, mode = self.worker, self.mode
        if mode == "polling":
            while not all(r.completed for r in reqs):
                w.progress()
        elif mode == "blocking":
            while not all(r.completed for r in reqs):
                w.progress_worker_event()
        elif mode.startswith("hybrid"):
            end = time.perf_counter() + self.spin
            while True:
                w.progress()
                if all(r.completed for r in reqs):
                    break
                if time.perf_counter() < end:
                    if self.yield_:
                        os.sched_yield()
                    continue
                if w.arm():
                    self.poller.poll(100)
        else:  # a progress thread does the work
            while not all(r.completed for r in reqs):
                time.sleep(0)
        for r in reqs:
            r.check_error()

    # the three operations
    def post(self, tag: int, buf) -> None:
        arr = self.Array(buf)
        self.posted[tag].append((self.ep.tag_recv(arr, tag=self.u.UCXXTag(tag)), buf, arr))
        if self.credits:
            self.grants.append(tag)
            if not self.lazy:
                self.flush()

    def flush(self) -> None:
        for tag in self.grants:
            cbuf = self.np.zeros(16, self.np.uint8)
            carr = self.Array(cbuf)
            req = self.ep.tag_send(carr, tag=self.u.UCXXTag(100 + tag))
            self.inflight = [x for x in self.inflight if not x[0].completed]
            if not req.completed:
                self.inflight.append((req, cbuf, carr))
        self.grants.clear()

    def wait_recv(self, tag: int) -> None:
        if self.grants:
            self.flush()
        req, _buf, _arr = self.posted[tag][0]
        self.wait([req])
        self.posted[tag].popleft()

    def send(self, tag: int, buf) -> None:
        if self.grants:
            self.flush()
        if self.credits:
            rx = self.credit_rx.get(tag)
            if rx is None:
                cbuf = self.np.zeros(16, self.np.uint8)
                rx = self.credit_rx[tag] = [None, cbuf, self.Array(cbuf)]
            if rx[0] is None:
                rx[0] = self.ep.tag_recv(rx[2], tag=self.u.UCXXTag(100 + tag))
            self.wait([rx[0]])
            rx[0] = self.ep.tag_recv(rx[2], tag=self.u.UCXXTag(100 + tag))  # keep one posted, like tensorwire
        arr = self.Array(buf)
        self.wait([self.ep.tag_send(arr, tag=self.u.UCXXTag(tag))])

    def close(self) -> None:
        if self.mode.startswith("thread"):
            self.worker.stop_progress_thread()


class _TwDriver:
    """tensorwire's UcxListener / UcxTransport."""

    def __init__(self, mode: str, spin_us: float) -> None:
        import torch

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.environ["TENSORWIRE_UCX_SPIN_US"] = str(spin_us)  # (a benchmark process of its own)
        from tensorwire.transport.ucx import UcxListener

        self.torch, self.Listener = torch, UcxListener
        self.nonce = b"n" * 16
        self.steps = collections.Counter()

    def listen(self, q) -> None:
        self.lst = self.Listener()
        self.lst.expect(self.nonce)
        q.put(self.lst.address[1])
        self.t = self.lst.accept(self.nonce, timeout=60)

    def connect(self, port: int) -> None:
        self.t = self.Listener.connect("127.0.0.1", port, self.nonce, timeout=60)

    def alloc(self, n: int, fill: int = 0):
        return self.torch.full((n,), fill, dtype=self.torch.uint8)

    def post(self, tag: int, buf) -> None:
        self.t.post_recv(tag, buf)

    def wait_recv(self, tag: int) -> None:
        self.t.wait_recv(tag, timeout=60)

    def send(self, tag: int, buf) -> None:
        self.steps[tag] += 1
        self.t.send(tag, buf, step=self.steps[tag], timeout=60)

    def close(self) -> None:
        self.t.close()
        if hasattr(self, "lst"):
            self.lst.close()


def _driver(mode: str, spin_us: float):
    return _TwDriver(mode, spin_us) if mode == "tensorwire" else _RawDriver(mode, spin_us)


# -- the traffic ------------------------------------------------------------------------------


def _server(mode: str, spin_us: float, q) -> None:
    d = _driver(mode, spin_us)
    d.listen(q)
    n = int(q.get())
    # RTT, pre-posted: the next receive buffer is posted before the reply goes out
    bufs = [d.alloc(4096), d.alloc(4096)]
    d.post(1, bufs[0])
    for i in range(n):
        d.wait_recv(1)
        if i + 1 < n:
            d.post(1, bufs[(i + 1) % 2])
        d.send(2, bufs[i % 2])
    # RTT, re-post late: one buffer, posted again only after the reply
    d.post(1, bufs[0])
    for i in range(n):
        d.wait_recv(1)
        d.send(2, bufs[0])
        if i + 1 < n:
            d.post(1, bufs[0])
    # throughput: N bytes in, 8-byte ack out
    ack = d.alloc(8, 1)
    for size in SIZES:
        big = d.alloc(size)
        d.post(3, big)
        for k in range(ITERS[size]):
            d.wait_recv(3)
            if k + 1 < ITERS[size]:
                d.post(3, big)
            d.send(4, ack)
        del big
    # idle: the client waits 1 s for this
    q.get()
    time.sleep(1.0)
    d.send(5, ack)
    q.get()
    d.close()


def _client(mode: str, spin_us: float, port: int, rtt_iters: int, q, res) -> None:
    d = _driver(mode, spin_us)
    d.connect(port)
    n = rtt_iters + WARMUP
    q.put(n)
    src = d.alloc(4096, 7)
    back = [d.alloc(4096), d.alloc(4096)]
    out = {}
    for key in ("rtt_us", "rtt_late_us"):
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            d.post(2, back[i % 2])
            d.send(1, src)
            d.wait_recv(2)
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        out[key] = statistics.median(times) * 1e6
    ack = d.alloc(8)
    for size in SIZES:
        big = d.alloc(size, 1)
        t0 = time.perf_counter()
        for _ in range(ITERS[size]):
            d.post(4, ack)
            d.send(3, big)
            d.wait_recv(4)
        out[size] = size * ITERS[size] / (time.perf_counter() - t0) / 2**20
        del big
    d.post(5, ack)
    q.put("go")
    c0 = time.process_time()
    t0 = time.perf_counter()
    d.wait_recv(5)
    out["idle_cpu_pct"] = 100 * (time.process_time() - c0) / (time.perf_counter() - t0)
    q.put("done")
    res.put(out)
    d.close()


def run_mode(mode: str, *, spin_us: float, rtt_iters: int) -> dict:
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(), ctx.Queue()
    sp = ctx.Process(target=_server, args=(mode, spin_us, q), daemon=True)
    sp.start()
    try:
        port = q.get(timeout=60)
        cp = ctx.Process(target=_client, args=(mode, spin_us, port, rtt_iters, q, res), daemon=True)
        cp.start()
        try:
            out = res.get(timeout=300)
            cp.join(30)
        finally:
            if cp.is_alive():
                cp.kill()
        sp.join(30)
        return out
    finally:
        if sp.is_alive():
            sp.kill()


# -- paired spin-policy experiment --------------------------------------------------------------
# Separate runs on a shared machine differ by the load of the moment more than by the policy.
# Here one process pair switches policy every BLOCK round trips, in rounds, so every policy sees
# the same conditions. --reply-delay-us makes the server busy-wait before answering (like
# application/Python work between receive and reply), so the client's spin outlasts its eager phase.

POLICIES = {  # name: (spin seconds, seconds of spinning before sched_yield() starts)
    "yield-always": (100e-6, 0.0),
    "yield-after-20us": (100e-6, 20e-6),
    "yield-after-50us": (100e-6, 50e-6),
    "no-yield": (100e-6, 100e-6),
}
BLOCK, ROUNDS = 200, 6


def _policy_wait(d: _RawDriver, reqs, spin: float, eager: float) -> None:
    w = d.worker
    t0 = time.perf_counter()
    end, eager_end = t0 + spin, t0 + eager
    while True:
        w.progress()
        if all(r.completed for r in reqs):
            break
        now = time.perf_counter()
        if now < end:
            if now >= eager_end:
                os.sched_yield()
            continue
        if w.arm():
            d.poller.poll(100)
    for r in reqs:
        r.check_error()


def _paired_server(delay_us: float, q) -> None:
    d = _RawDriver("hybrid", 100)
    d.listen(q)
    buf = d.alloc(4096)
    arr = d.Array(buf)
    T = d.u.UCXXTag
    for _ in range(ROUNDS):
        for spin, eager in POLICIES.values():
            for _ in range(BLOCK):
                _policy_wait(d, [d.ep.tag_recv(arr, tag=T(1))], spin, eager)
                busy_until = time.perf_counter() + delay_us / 1e6
                while time.perf_counter() < busy_until:
                    pass
                _policy_wait(d, [d.ep.tag_send(arr, tag=T(2))], spin, eager)
    q.get()


def _paired_client(port: int, res) -> None:
    d = _RawDriver("hybrid", 100)
    d.connect(port)
    src, dst = d.Array(d.alloc(4096, 1)), d.Array(d.alloc(4096))
    T = d.u.UCXXTag
    times = {name: [] for name in POLICIES}
    for rnd in range(ROUNDS):
        for name, (spin, eager) in POLICIES.items():
            for i in range(BLOCK):
                t0 = time.perf_counter()
                r = d.ep.tag_recv(dst, tag=T(2))
                _policy_wait(d, [d.ep.tag_send(src, tag=T(1)), r], spin, eager)
                if rnd or i >= 50:
                    times[name].append(time.perf_counter() - t0)
    res.put({n: (statistics.median(v) * 1e6, statistics.quantiles(v, n=10)[-1] * 1e6) for n, v in times.items()})


def paired_yield(delay_us: float) -> None:
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(), ctx.Queue()
    sp = ctx.Process(target=_paired_server, args=(delay_us, q), daemon=True)
    sp.start()
    cp = None
    try:
        cp = ctx.Process(target=_paired_client, args=(q.get(timeout=60), res), daemon=True)
        cp.start()
        out = res.get(timeout=300)
        q.put("done")
    finally:
        for p in (cp, sp):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
    print(f"paired spin policies, server reply delay {delay_us:g} µs, load {os.getloadavg()[0]:.1f}")
    print("| policy | 4 KiB RTT µs median | p90 |")
    print("|---|---:|---:|")
    for name, (med, p90) in out.items():
        print(f"| {name} | {med:.1f} | {p90:.1f} |")


def environment() -> str:
    import ucxx

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (f"nproc={os.cpu_count()}, CPU={cpu}, Python {platform.python_version()}, "
            f"ucxx {ucxx.__version__}, UCX {ucxx.__ucx_version__}, UCX_TLS={os.environ.get('UCX_TLS', 'all (default)')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=ALL_MODES, choices=ALL_MODES)
    ap.add_argument("--rtt-iters", type=int, default=2000)
    ap.add_argument("--spin-us", type=float, default=100.0, help="hybrid/tensorwire: spin this long before sleeping")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every mode this many times (interleaved) and report medians: use on a shared machine")
    ap.add_argument("--paired-yield", action="store_true",
                    help="instead: compare spin/yield policies interleaved in one process pair")
    ap.add_argument("--reply-delay-us", type=float, default=0.0, help="--paired-yield: server work before replying")
    args = ap.parse_args()
    print(environment())
    if args.paired_yield:
        paired_yield(args.reply_delay_us)
        return
    runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    loads = []
    for _ in range(args.repeat):
        for mode in args.modes:
            loads.append(os.getloadavg()[0])
            try:
                runs[mode].append(run_mode(mode, spin_us=args.spin_us, rtt_iters=args.rtt_iters))
            except Exception as exc:  # noqa: BLE001
                print(f"{mode}: failed: {exc!r}", file=sys.stderr)
    print(f"runs per mode: {args.repeat}; spin {args.spin_us:g} µs; 1-min load average at the starts: "
          f"{min(loads):.1f}..{max(loads):.1f}; figures are medians over the runs")
    print()
    print("| mode | 4 KiB RTT µs, pre-posted | (range) | 4 KiB RTT µs, re-post late | 1 MiB MiB/s | 16 MiB MiB/s "
          "| 128 MiB MiB/s | idle wait CPU % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, rs in runs.items():
        if not rs:
            print(f"| {mode} | failed | | | | | | |")
            continue

        def med(key):
            return statistics.median(r[key] for r in rs)

        rtts = [r["rtt_us"] for r in rs]
        print(f"| {mode} | {med('rtt_us'):.1f} | {min(rtts):.0f}–{max(rtts):.0f} | {med('rtt_late_us'):.1f} "
              f"| {med(SIZES[0]):.0f} | {med(SIZES[1]):.0f} | {med(SIZES[2]):.0f} | {med('idle_cpu_pct'):.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
