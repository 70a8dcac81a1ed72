"""``tensorwire bench``: argument parsing only; the work is in :mod:`.runner` and :mod:`.report`."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Sequence

__all__ = ["register", "add_arguments", "config_from_args", "run"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BACKEND_FAILED = 0, 1, 3

DESCRIPTION = """\
The same bytes through tensorwire (UCX and TCP transports, real Node/Link in two
processes) and its peers: gRPC (unary, client-streaming), a raw TCP socket, raw
ucxx, torch.distributed (gloo / NCCL) and NIXL when installed. Prints an
OSU/nccl-tests style table with ratios to gRPC, to the best peer and to the raw
socket, the first-transfer (registration) cost, wake-ups per round trip, a
memory check of 1,000 Link steps, and the environment. Progress goes to stderr.
"""

EPILOG = """\
backends: all (default), tensorwire, grpc, raw, torch, or names:
  tensorwire-tcp tensorwire-ucx tensorwire-ucx-isend grpc-unary grpc-stream
  raw-tcp raw-ucxx raw-ucxx-cm raw-ucxx-cmnoerr raw-ucxx-2buf torch-gloo torch-nccl nixl
examples:
  tensorwire bench                                   # CPU, 4 KiB .. 256 MiB, all backends
  tensorwire bench --max-size 1M --check             # quick correctness pass
  tensorwire bench --device cuda --backends tensorwire-ucx,torch,raw-ucxx,grpc
  tensorwire bench --out-dir results/ --name cpu_loopback   # .md .json .csv .png
exit status: 0 ok, 1 a --check found corrupted data, 3 a backend failed (only with --strict)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backends",
        "-b",
        action="append",
        default=None,
        metavar="LIST",
        help="comma-separated backends or groups (repeatable; default: all)",
    )
    p.add_argument("--min-size", default="4K", help="smallest message (default 4K)")
    p.add_argument(
        "--max-size",
        default=None,
        help="largest message (default 256M on CPU, 1G with --device cuda); powers of two in between",
    )
    p.add_argument("--sizes", default=None, help="explicit comma-separated sizes instead of --min/--max-size")
    p.add_argument(
        "--patterns", default="uni,rtt", help="uni (stream of sends, one ack), rtt (send + ack); default both"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the buffers live on both sides")
    p.add_argument("--check", action="store_true", help="verify every received buffer bit-exact (slower)")
    p.add_argument(
        "--iters-scale", type=float, default=1.0, help="multiply iteration counts (e.g. 0.1 for a quick run)"
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds one backend may take (default: from the bytes)")
    p.add_argument("--op-timeout", type=float, default=120.0, help="seconds one send/recv may take (default 120)")
    p.add_argument("--host", default="127.0.0.1", help="address the receiving side binds (default loopback)")
    p.add_argument("--grpc-chunk", default="1M", help="chunk size of grpc-stream (default 1M)")
    p.add_argument("--grpc-max-size", default=None, help="largest message for the gRPC backends (default: --max-size)")
    p.add_argument("--no-memcheck", action="store_true", help="skip the 1,000-step Link memory check")
    p.add_argument("--memcheck-steps", type=int, default=1000)
    p.add_argument("--json", metavar="PATH", help="write raw timings + summary as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one row per backend and size")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    p.add_argument("--markdown", metavar="PATH", help="write the tables as markdown")
    p.add_argument("--out-dir", metavar="DIR", help="write NAME.{md,json,csv,png} into DIR")
    p.add_argument("--name", default="bench", help="file stem for --out-dir (default bench)")
    p.add_argument("--from-json", metavar="PATH", help="re-render the table/files from a saved --json (no run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--strict", action="store_true", help="exit 3 if any backend failed")
    p.add_argument("--inject-corruption", metavar="BACKEND", default=None, help=argparse.SUPPRESS)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark tensorwire against gRPC, raw sockets, UCX, torch.distributed",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    from tensorwire.benchmark.backends import resolve
    from tensorwire.benchmark.config import (
        DEFAULT_MAX_SIZE_CPU,
        DEFAULT_MAX_SIZE_CUDA,
        BenchConfig,
        default_sizes,
        parse_size,
    )

    if args.sizes:
        sizes = tuple(sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()}))
    else:
        max_size = (
            parse_size(args.max_size)
            if args.max_size
            else (DEFAULT_MAX_SIZE_CUDA if args.device == "cuda" else DEFAULT_MAX_SIZE_CPU)
        )
        sizes = default_sizes(parse_size(args.min_size), max_size)
    backends = resolve(args.backends or ["all"], device=args.device)
    return BenchConfig(
        backends=backends,
        sizes=sizes,
        patterns=tuple(p.strip() for p in args.patterns.split(",") if p.strip()),
        device=args.device,
        check=args.check,
        iters_scale=args.iters_scale,
        timeout=args.timeout,
        op_timeout=args.op_timeout,
        host=args.host,
        grpc_chunk=parse_size(args.grpc_chunk),
        inject_corruption=args.inject_corruption,
        memcheck=not args.no_memcheck,
        grpc_max_size=parse_size(args.grpc_max_size) if args.grpc_max_size else None,
        memcheck_steps=args.memcheck_steps,
    )


def run(args: argparse.Namespace, *, argv: Sequence[str] | None = None) -> int:
    from tensorwire.benchmark import report
    from tensorwire.benchmark.runner import Progress, execute

    if argv is None:
        argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else sys.argv[1:]
    command = "tensorwire bench " + " ".join(shlex.quote(a) for a in argv)
    if args.from_json:
        with open(args.from_json) as f:
            raw = json.load(f)
        raw.pop("summary", None)
        raw.pop("format", None)
        command = raw.get("command") or command
    else:
        cfg = config_from_args(args)
        progress = Progress(len(cfg.backends), enabled=not args.no_progress)
        json_path = args.json or (os.path.join(args.out_dir, f"{args.name}.json") if args.out_dir else None)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)

        def checkpoint(partial: dict[str, Any]) -> None:
            if json_path:
                report.write_json(json_path, partial, report.summarize(partial))

        raw = execute(cfg, progress=progress, command=command, checkpoint=checkpoint)
        # Summarize exactly what the JSON keeps (7 significant digits), so `--from-json`
        # re-renders the same table digit for digit.
        raw = report.as_saved(raw)
    summary = report.summarize(raw)
    sys.stdout.write(report.render_text(raw, summary))
    sys.stdout.flush()
    paths = {"json": args.json, "csv": args.csv, "plot": args.plot, "markdown": args.markdown}
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        for key, ext in (("json", "json"), ("csv", "csv"), ("plot", "png"), ("markdown", "md")):
            paths[key] = paths[key] or os.path.join(args.out_dir, f"{args.name}.{ext}")
    if paths["json"]:
        report.write_json(paths["json"], raw, summary)
    if paths["csv"]:
        report.write_csv(paths["csv"], raw, summary)
    if paths["markdown"]:
        with open(paths["markdown"], "w") as f:
            f.write(report.render_markdown(raw, summary, command=command))
    if paths["plot"]:
        why = report.plot(paths["plot"], raw, summary)
        if why:
            print(f"tensorwire bench: no plot: {why}", file=sys.stderr)
    if any(r.get("check_failed") for r in raw["backends"].values()):
        return EXIT_CHECK_FAILED
    if args.strict and any(r.get("status") == "failed" for r in raw["backends"].values()):
        return EXIT_BACKEND_FAILED
    return EXIT_OK
