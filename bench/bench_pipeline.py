#!/usr/bin/env python
"""The pipeline example's exchange over tensorwire vs the same exchange over gRPC (2 stages, CPU).

::

    python bench/bench_pipeline.py                        # launches torchrun itself, writes the results file
    python bench/bench_pipeline.py --out bench/results/pipeline_cpu2_$(date +%F).md --rounds 3

One run = one ``torchrun --standalone --nproc-per-node 2`` job (this script
re-launches itself as the workers). Both ranks build the model of
``examples/pipeline_parallel.py``, take their stage, and get its specs from
``tw.discover`` exactly as the example does. Then, per configuration, in
alternating blocks (``--rounds`` times tensorwire then gRPC, so a load change
on the shared machine hits both):

- **exchange**: the GPipe message schedule of one step with no compute —
  stage 0 sends the activation of each of the M microbatches, then receives
  the M gradients; stage 1 receives the M activations, then sends the M
  gradients. Time per step = rank 0's wall time from its first send to its
  last receive (median over steps);
- **train**: real training steps of the example (``pipeline_step``, forward
  and backward compute included) through each exchange; reported: step time
  and the time spent inside send/recv (which includes waiting for the peer).

The gRPC variant is kept honest: the same tensors (shapes, dtypes, values)
and the same number of messages — one unary call per tensor per microbatch
per direction, raw ``bytes`` payloads (no protobuf message: gRPC's cheapest
path), 1 GiB message limits, the receiving server enqueues the payload and
the receiver copies it into the same kind of preallocated buffer the
tensorwire path fills. Channels are connected and warmed up before timing.
What differs is the mechanism: a unary call returns after the peer's
answer, a tensorwire ``send`` once the bytes are out (flow control by
credits), and tensorwire receives straight into its slot.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "pipeline_parallel.py"
# bench/results/<benchmark>_<machine kind>_<date>.md; the kind defaults to cpu<cores> (rename for a GPU host)
DEFAULT_OUT = REPO / "bench" / "results" / f"pipeline_cpu{os.cpu_count()}_{_dt.date.today():%Y-%m-%d}.md"
GRPC_LIMIT = 1 << 30
GRPC_OPTIONS = [("grpc.max_send_message_length", GRPC_LIMIT), ("grpc.max_receive_message_length", GRPC_LIMIT)]


def load_example() -> Any:
    name = "pipeline_parallel_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------
# the gRPC exchange (same interface as the example's TensorwireComm)
# ---------------------------------------------------------------------------


class GrpcComm:
    """Activations/gradients as raw bytes in unary gRPC calls, one call per tensor per microbatch."""

    def __init__(
        self, node: Any, plan: Any, *, n_stages: int, microbatches: int, tag: str, timeout: float = 60
    ) -> None:
        import grpc
        import torch

        ex = load_example()
        self.stats = ex.Stats()
        self.rank = node.rank
        self.timeout = timeout
        self._q = {"act": queue.Queue(), "grad": queue.Queue()}

        def handler(kind: str):
            def on(request: bytes, context: Any) -> bytes:
                self._q[kind].put(request)
                return b""

            return on

        methods = {
            "Act": grpc.unary_unary_rpc_method_handler(handler("act")),
            "Grad": grpc.unary_unary_rpc_method_handler(handler("grad")),
        }
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Pipeline", methods),))
        host = node.host
        port = self._server.add_insecure_port(f"[{host}]:0" if ":" in host else f"{host}:0")
        self._server.start()
        from datetime import timedelta

        key = lambda r: node.prefix + f"bench/grpc/{tag}/{r}"  # noqa: E731
        node.store.set(key(self.rank), f"{host}:{port}")
        self._channels = []

        def stub(peer: int, method: str) -> Any:
            node.store.wait([key(peer)], timedelta(seconds=timeout))
            ch = grpc.insecure_channel(node.store.get(key(peer)).decode(), options=GRPC_OPTIONS)
            grpc.channel_ready_future(ch).result(timeout=timeout)
            self._channels.append(ch)
            return ch.unary_unary(f"/bench.Pipeline/{method}")

        self.prev_grad = stub(self.rank - 1, "Grad") if self.rank > 0 else None
        self.next_act = stub(self.rank + 1, "Act") if self.rank < n_stages - 1 else None
        self.inputs = (
            [[torch.empty(s.shape, dtype=s.torch_dtype) for s in plan.inputs] for _ in range(microbatches)]
            if self.rank > 0
            else []
        )
        self.grad_bufs = [torch.empty(s.shape, dtype=s.torch_dtype) for s in plan.grads_of_outputs]

    @staticmethod
    def _into(buf: Any, payload: bytes) -> None:
        import numpy as np

        flat = buf.numpy().reshape(-1)
        flat[:] = np.frombuffer(payload, dtype=flat.dtype)

    def send_forward(self, tensors: Sequence[Any]) -> None:
        t0 = time.perf_counter()
        n = 0
        for t in tensors:
            data = t.detach().contiguous().numpy().tobytes()
            self.next_act(data, timeout=self.timeout)
            n += len(data)
        self.stats.add(n, time.perf_counter() - t0)

    def recv_forward(self, m: int) -> list[Any]:
        t0 = time.perf_counter()
        bufs = self.inputs[m]
        for buf in bufs:
            self._into(buf, self._q["act"].get(timeout=self.timeout))
        self.stats.add(sum(b.numel() * b.element_size() for b in bufs), time.perf_counter() - t0)
        return bufs

    def send_backward(self, tensors: Sequence[Any]) -> None:
        t0 = time.perf_counter()
        n = 0
        for t in tensors:
            data = t.detach().contiguous().numpy().tobytes()
            self.prev_grad(data, timeout=self.timeout)
            n += len(data)
        self.stats.add(n, time.perf_counter() - t0)

    def recv_backward(self) -> list[Any]:
        t0 = time.perf_counter()
        for buf in self.grad_bufs:
            self._into(buf, self._q["grad"].get(timeout=self.timeout))
        self.stats.add(sum(b.numel() * b.element_size() for b in self.grad_bufs), time.perf_counter() - t0)
        return self.grad_bufs

    def close(self) -> None:
        for ch in self._channels:
            ch.close()
        self._server.stop(0.5).wait(2)


# ---------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------


def exchange_step(comm: Any, plan: Any, cfg: Any, rank: int, payload: dict[str, list[Any]]) -> float:
    """One step of the GPipe schedule without compute; returns this rank's wall seconds."""
    t0 = time.perf_counter()
    if rank == 0:
        for _ in range(cfg.microbatches):
            comm.send_forward(payload["act"])
        for _ in range(cfg.microbatches):
            comm.recv_backward()
    else:
        for m in range(cfg.microbatches):
            comm.recv_forward(m)
        for _ in range(cfg.microbatches):
            comm.send_backward(payload["grad"])
    return time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    import torch

    ex = load_example()
    tw = ex.tw
    node = tw.init(transport=args.transport)
    rank = node.rank
    assert node.world_size == 2, "the bench runs 2 stages"
    results: dict[str, Any] = {"rank": rank, "exchange": [], "train": []}

    configs = [("exchange", h) for h in args.hidden] + [("train", args.train_hidden)]
    for ci, (what, hidden) in enumerate(configs):
        cfg = ex.Config(
            hidden=hidden,
            batch=args.batch,
            microbatches=args.microbatches,
            layers=args.layers,
            steps=args.steps,
            d_in=hidden,
            d_out=hidden,
        )
        model = ex.build_model(cfg)
        stage = ex.build_stage(model, 2, rank)
        plan = tw.discover(stage, torch.zeros(cfg.microbatch, cfg.d_in if rank == 0 else cfg.hidden))
        g = torch.Generator().manual_seed(rank)
        payload = {
            "act": [torch.randn(s.shape, generator=g) for s in plan.outputs],
            "grad": [torch.randn(s.shape, generator=g) for s in plan.grads_of_inputs],
        }
        per_msg = (plan.outputs if rank == 0 else plan.inputs)[0].nbytes
        times: dict[str, list[float]] = {"tensorwire": [], "grpc": []}
        inside: dict[str, list[float]] = {"tensorwire": [], "grpc": []}
        transport = None
        for rnd in range(args.rounds):
            for variant in ("tensorwire", "grpc"):
                tag = f"{ci}.{rnd}.{variant}"
                if variant == "tensorwire":
                    # a fresh link per block, like a fresh channel for gRPC; set-up is outside the timing
                    comm = ex.TensorwireComm(
                        node,
                        plan,
                        n_stages=2,
                        microbatches=cfg.microbatches,
                        device=torch.device("cpu"),
                        link_name=f"bench.{tag}",
                    )
                    transport = comm.transports
                else:
                    comm = GrpcComm(node, plan, n_stages=2, microbatches=cfg.microbatches, tag=tag)
                try:
                    if what == "exchange":
                        for _ in range(args.warmup):
                            exchange_step(comm, plan, cfg, rank, payload)
                        for _ in range(args.steps):
                            times[variant].append(exchange_step(comm, plan, cfg, rank, payload))
                    else:
                        opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
                        for step in range(args.warmup + args.steps):
                            t0 = time.perf_counter()
                            ex.pipeline_step(
                                stage, opt, comm, cfg, step, first=rank == 0, last=rank == 1, device=torch.device("cpu")
                            )
                            dt = time.perf_counter() - t0
                            _, secs = comm.stats.end_step()
                            if step >= args.warmup:
                                times[variant].append(dt)
                                inside[variant].append(secs)
                finally:
                    comm.close()
        results[what].append(
            {
                "hidden": hidden,
                "batch": cfg.batch,
                "microbatches": cfg.microbatches,
                "msg_bytes": per_msg,
                "msgs_per_step": 2 * cfg.microbatches,
                "transport": transport,
                "times": times,
                "inside": inside,
            }
        )
        print(
            f"[rank {rank}] {what} hidden={hidden}: tensorwire {statistics.median(times['tensorwire']) * 1e3:.2f} ms, "
            f"grpc {statistics.median(times['grpc']) * 1e3:.2f} ms",
            flush=True,
        )
    if args.json_out:
        Path(f"{args.json_out}.rank{rank}").write_text(json.dumps(results))
    node.close()


# ---------------------------------------------------------------------------
# launcher / report
# ---------------------------------------------------------------------------


def _load1() -> float:
    return os.getloadavg()[0]


def _versions() -> str:
    import grpc
    import torch

    try:
        import ucxx  # noqa: F401
        from importlib.metadata import version

        ucx = version("ucxx-cu12")
    except Exception:  # noqa: BLE001
        ucx = "not installed"
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (
        f"nproc {os.cpu_count()}; cpu {cpu}; memory {mem:.0f} GiB; os {platform.platform()}; "
        f"python {platform.python_version()}; torch {torch.__version__}; grpcio {grpc.__version__}; "
        f"ucxx {ucx}; cuda {torch.cuda.is_available()}"
    )


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def report(
    res: dict[str, Any], *, command: str, elapsed: float, load: tuple[float, float], args: argparse.Namespace
) -> str:
    r0 = res
    lines = [
        "# Pipeline exchange: tensorwire vs gRPC (2 stages, CPU)",
        "",
        f"Command (from the repository root): `{command}` ({elapsed:.0f} s, "
        f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}).",
        "",
        f"Machine: {_versions()}.",
        "",
        f"Load average (1 min) at the start {load[0]:.1f}, at the end {load[1]:.1f} (the 2-core machine is "
        "shared with other jobs: figures are noisy; variants alternate in blocks so both see the same load).",
        "",
        "Two workers under `torchrun --standalone --nproc-per-node 2`, one stage each, specs from `tw.discover` "
        "on the stage as in `examples/pipeline_parallel.py`. **exchange**: one GPipe step's messages without "
        "compute (stage 0 sends M activations, then receives M gradients; stage 1 the mirror); time = rank 0's "
        "wall time for the step, median over "
        f"{args.steps} steps x {args.rounds} rounds after {args.warmup} warm-up steps per round. gRPC: one unary "
        "call per tensor per microbatch, raw bytes (no protobuf), 1 GiB limits, received into a preallocated "
        "buffer. Same tensors, same number of messages.",
        "",
    ]
    lines += [
        "| config | message | msgs/step | bytes/step | tensorwire | gRPC unary | ratio (tw / gRPC) | target <= 0.33 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    for row in r0["exchange"]:
        tw_t = statistics.median(row["times"]["tensorwire"])
        g_t = statistics.median(row["times"]["grpc"])
        ratio = tw_t / g_t
        ok = ratio <= 1 / 3
        verdicts.append(ok)
        per_step = row["msg_bytes"] * row["msgs_per_step"]
        lines.append(
            f"| exchange, batch {row['batch']} x hidden {row['hidden']}, M={row['microbatches']} "
            f"({'/'.join(sorted(set((row['transport'] or {}).values()))) or '?'}) | {_size(row['msg_bytes'])} | "
            f"{row['msgs_per_step']} | {_size(per_step)} | {_ms(tw_t)} "
            f"({per_step / tw_t / 1e9:.2f} GB/s) | {_ms(g_t)} ({per_step / g_t / 1e9:.2f} GB/s) | "
            f"{ratio:.2f} | {'met' if ok else 'MISSED'} |"
        )
    lines += [
        "",
        "Training steps of the example through each exchange (compute included; `send+recv` includes "
        "waiting for the other stage, i.e. the pipeline bubble):",
        "",
        "| config | variant | step time | send+recv per step | share of step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in r0["train"]:
        for v in ("tensorwire", "grpc"):
            st = statistics.median(row["times"][v])
            ins = statistics.median(row["inside"][v])
            lines.append(
                f"| train, batch {row['batch']} x hidden {row['hidden']}, {args.layers} layers, "
                f"M={row['microbatches']} | {v} | {_ms(st)} | {_ms(ins)} | {ins / st:.0%} |"
            )
        tw_i = statistics.median(row["inside"]["tensorwire"])
        g_i = statistics.median(row["inside"]["grpc"])
        lines.append(f"| | ratio of send+recv (tw / gRPC) | | {tw_i / g_i:.2f} | |")
    lines += [
        "",
        f"Target (tensorwire exchange time <= 1/3 of gRPC's): "
        f"{sum(verdicts)} of {len(verdicts)} exchange configurations met.",
        "",
    ]
    return "\n".join(lines)


def launcher(args: argparse.Namespace) -> int:
    import tempfile

    t0 = time.time()
    load0 = _load1()
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "res.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
            str(Path(__file__).resolve()),
            "--worker",
            "--json-out",
            js,
            *sys.argv[1:],
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("OMP_NUM_THREADS", "1")
        p = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True)
        try:
            rc = p.wait(args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
            print(f"bench did not finish within {args.timeout}s", file=sys.stderr)
            return 1
        if rc != 0:
            print(f"torchrun exited {rc}", file=sys.stderr)
            return rc
        res = json.loads(Path(js + ".rank0").read_text())
    command = "python bench/bench_pipeline.py" + ("" if len(sys.argv) == 1 else " " + " ".join(sys.argv[1:]))
    text = report(res, command=command, elapsed=time.time() - t0, load=(load0, _load1()), args=args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        default=[64, 512, 2048],
        help="hidden sizes of the exchange-only configurations (message = batch/M x hidden floats)",
    )
    p.add_argument("--train-hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="alternating tensorwire/gRPC blocks")
    p.add_argument("--transport", default="auto", choices=["auto", "tcp", "ucx"])
    p.add_argument("--out", default=str(DEFAULT_OUT.relative_to(REPO)))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
