"""Latency of ordinary clients of ``tensorwire serve`` with and without an attack, side by side.

Not a test. One daemon (TCP data plane, no shared memory: every byte crosses
the data port the attack floods), one measuring client, and a load process that
switches the attack on and off between turns, so loaded and unloaded phases
alternate and a drifting machine weighs on both. The attack (issue 13's target,
plus hole 12's waiting writers):

- ``--flood`` (1,000) idle, unauthenticated TCP connections to the data port,
  all of them reconnected every 2 s (those the daemon dropped meanwhile included);
- one client holding ``--hog`` (64) sessions, idle;
- ``--waiters`` (40) raw BeginPut calls on a name another put keeps reserved,
  each called again 0.2 s after its answer (tw.Client's longest backoff).

Measured per turn and phase, on the measuring client: ``get`` and ``put`` of a
64 KiB tensor on its open session, ``list``, and ``connect`` (a new client:
OpenSession, the data connection, one get, close). Prints p50/p90 unloaded vs
loaded and their ratio, and writes a Markdown table. All traffic is on 127.0.0.1.

    python bench/bench_attack.py [--rounds 6] [--out bench/results/attack_cpu2_2026-11-24.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# -- the load process ---------------------------------------------------------------------------
def load_main(address: str, data_port: int, flood_n: int, hog_n: int, waiters_n: int) -> None:
    """Reads ``on`` / ``off`` / ``quit`` lines on stdin; answers each on stdout once done."""
    import grpc
    import torch

    import tensorwire as tw
    from flood import Flood, raise_nofile
    from tensorwire.serve.protocol.common import PROTOCOL_VERSION
    from tensorwire._proto import spec_to_proto
    from tensorwire.v1 import store_pb2, store_pb2_grpc

    raise_nofile(16384)
    state: dict = {}

    def waiter_loop(stop: threading.Event, stub, sid: str, spec) -> None:
        while not stop.is_set():
            try:
                stub.BeginPut(store_pb2.BeginPutRequest(session_id=sid, spec=spec, timeout_ms=3_600_000), timeout=5)
            except grpc.RpcError:
                pass
            stop.wait(0.2)  # as tw.Client's backoff does at most

    def on() -> None:
        flood = Flood(data_port, flood_n, refresh=2.0).__enter__()
        hog = [tw.Client(address, transport="tcp", name=f"hog-{i}") for i in range(hog_n)]
        holder = tw.Client(address, transport="tcp", data_requests=False, name="holder")
        holder.put("hot", torch.zeros(1024))
        sid, _ = holder._session()
        spec = spec_to_proto(tw.TensorSpec("hot", (1024,), "float32"))
        holder._stub.BeginPut(store_pb2.BeginPutRequest(session_id=sid, spec=spec, timeout_ms=3_600_000), timeout=10)
        ch = grpc.insecure_channel(address)
        stub = store_pb2_grpc.StoreStub(ch)
        stop = threading.Event()
        threads = []
        for _ in range(waiters_n):
            wsid = stub.OpenSession(
                store_pb2.OpenSessionRequest(protocol_version=PROTOCOL_VERSION, transport="tcp"), timeout=10
            ).session_id
            th = threading.Thread(target=waiter_loop, args=(stop, stub, wsid, spec), daemon=True)
            th.start()
            threads.append(th)
        state.update(flood=flood, hog=hog, holder=holder, ch=ch, stop=stop, threads=threads)

    def off() -> None:
        state["stop"].set()
        for th in state["threads"]:
            th.join(10)
        state["ch"].close()
        state["flood"].__exit__(None, None, None)
        for c in state["hog"]:
            c.close()
        state["holder"].close()
        opened = state["flood"].opened
        state.clear()
        return opened

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "on":
            on()
            print(json.dumps({"on": True}), flush=True)
        elif cmd == "off":
            print(json.dumps({"off": True, "flood_opened": off()}), flush=True)
        elif cmd == "quit":
            return


# -- the measuring side ---------------------------------------------------------------------------
def _ask(proc: subprocess.Popen, cmd: str) -> dict:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"load process died (rc={proc.poll()})")
    return json.loads(line)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(address: str, n: int, results: dict[str, list[float]], failures: list[str]) -> None:
    import torch

    import tensorwire as tw

    t = torch.randn(16384)  # 64 KiB
    with tw.Client(address, transport="tcp", name="victim") as c:
        c.put("victim", t)
        c.get("victim")
        for _ in range(n):
            for op, fn in (
                ("get 64 KiB", lambda: c.get("victim")),
                ("put 64 KiB", lambda: c.put("victim", t)),
                ("list", c.list),
            ):
                t0 = time.perf_counter()
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - counted
                    failures.append(f"{op}: {exc!r}")
                    continue
                results[op].append(time.perf_counter() - t0)
    for _ in range(max(3, n // 10)):
        t0 = time.perf_counter()
        try:
            with tw.Client(address, transport="tcp", name="newcomer") as c2:
                c2.get("victim")
        except Exception as exc:  # noqa: BLE001 - counted
            failures.append(f"connect: {exc!r}")
            continue
        results["connect (new client + get)"].append(time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ops", type=int, default=60, help="operations of each kind per phase")
    ap.add_argument("--flood", type=int, default=1000)
    ap.add_argument("--hog", type=int, default=64)
    ap.add_argument("--waiters", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--load", nargs=2, metavar=("ADDRESS", "DATA_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        load_main(args.load[0], int(args.load[1]), args.flood, args.hog, args.waiters)
        return 0

    from flood import raise_nofile, rss_bytes
    from serve_common import Daemon

    raise_nofile(16384)
    ops = ["get 64 KiB", "put 64 KiB", "list", "connect (new client + get)"]
    res = {ph: {op: [] for op in ops} for ph in ("unloaded", "loaded")}
    fails: dict[str, list[str]] = {"unloaded": [], "loaded": []}
    rss = {"unloaded": [], "loaded": []}
    with Daemon("--no-shm", transport="tcp") as d:
        data_port = d.info["data"][0]["port"]
        load = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--load",
                d.address,
                str(data_port),
                "--flood",
                str(args.flood),
                "--hog",
                str(args.hog),
                "--waiters",
                str(args.waiters),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        opened = 0
        try:
            for r in range(args.rounds):
                for phase in ("unloaded", "loaded") if r % 2 == 0 else ("loaded", "unloaded"):
                    if phase == "loaded":
                        _ask(load, "on")
                        time.sleep(1.0)
                    measure(d.address, args.ops, res[phase], fails[phase])
                    rss[phase].append(rss_bytes(d.proc.pid))
                    if phase == "loaded":
                        opened += _ask(load, "off")["flood_opened"]
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            load.stdin.write("quit\n")
            load.stdin.flush()
            load.wait(30)
        finally:
            if load.poll() is None:
                load.kill()
        alive = d.proc.poll() is None

    lines = [
        "| operation | unloaded p50 | loaded p50 | ratio p50 | unloaded p90 | loaded p90 | ratio p90 | ops (unloaded / loaded) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    worst = 0.0
    for op in ops:
        u, l_ = res["unloaded"][op], res["loaded"][op]
        if not u or not l_:
            lines.append(f"| {op} | - | - | - | - | - | - | {len(u)} / {len(l_)} |")
            continue
        u50, l50, u90, l90 = statistics.median(u), statistics.median(l_), _pct(u, 0.9), _pct(l_, 0.9)
        worst = max(worst, l50 / u50)
        lines.append(
            f"| {op} | {u50 * 1e3:.2f} ms | {l50 * 1e3:.2f} ms | {l50 / u50:.2f}x | {u90 * 1e3:.2f} ms | "
            f"{l90 * 1e3:.2f} ms | {l90 / u90:.2f}x | {len(u)} / {len(l_)} |"
        )
    table = "\n".join(lines)
    summary = (
        f"failed operations: unloaded {len(fails['unloaded'])}, loaded {len(fails['loaded'])}; "
        f"worst p50 ratio {worst:.2f}x; flood connections opened in all loaded phases: {opened}; "
        f"daemon RSS max unloaded {max(rss['unloaded']) / 2**20:.0f} MiB, loaded {max(rss['loaded']) / 2**20:.0f} MiB; "
        f"daemon alive at the end: {alive}"
    )
    print(table)
    print(summary)
    for ph in ("unloaded", "loaded"):
        for f in fails[ph][:5]:
            print(f"  {ph} failure: {f}")
    if args.out:
        cmd = "python bench/bench_attack.py " + " ".join(a for a in sys.argv[1:])
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# Clients of `tensorwire serve` under attack vs unloaded (2026-11-24)\n\n")
            f.write(f"Command: `{cmd}`\n\n")
            f.write(
                f"Machine: {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, "
                f"Python {platform.python_version()}. Shared with other work while it ran: noisy.\n\n"
            )
            f.write(
                f"Attack in the loaded phases: {args.flood} idle unauthenticated connections to the TCP data port "
                f"(all reconnected every 2 s), one client holding {args.hog} idle sessions, "
                f"{args.waiters} raw BeginPut calls on a name another put keeps reserved, each called again "
                f"0.2 s after its answer. {args.rounds} rounds, loaded and unloaded phases in alternating order, {args.ops} "
                f"operations of each kind per phase on an open session, plus new clients.\n\n"
            )
            f.write(table + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
