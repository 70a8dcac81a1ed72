"""Where a lease ``get_rows`` over shared memory spends its time, beside a local ``index_select(out=)``.

``bench/bench_serve.py`` finds a lease get_rows into a CPU tensor slower than a local
``torch.index_select(table, 0, idx, out=...)`` on a 16-core host (0.56x), while the gather it times inside
the call takes no longer than the local one. This probe splits the call, in turns in one process, against a
daemon of its own (``tensorwire serve``, shared memory):

- ``client``: ``Client.get_rows("table", idx, out=out)``, the whole call;
- ``leased view``: ``torch.index_select`` from the client's own tensor view of the daemon's slot (the gather
  the call makes, without the call);
- ``own shm``: the same from a tensor over a shared-memory file this process made and filled (``/dev/shm``:
  the page size and mapping of the slot, no daemon);
- ``local``: the same from an ordinary tensor (torch's allocator: what bench_serve compares with);
- ``tcp client`` (``--tcp-client``): a second client's get_rows over the daemon's TCP data connection;
- ``client -> cuda`` (``--gpu-client``, a CUDA host): the first client's get_rows into a CUDA tensor (the GPU
  gathers from the daemon's pages, which the client registers with CUDA), synchronised -- as in bench_serve,
  where the GPU paths read the same table between the CPU ones.

After the timed turns, each path's page faults per call (minor and major, ``getrusage``), in an untimed pass:
a gather that faults reads memory the process has not mapped yet, or no longer.

Then the whole call under ``cProfile`` (the functions with the most time of their own). Every path gets the
same indexes and the same destination; medians of ``--reps`` calls per path, ``--per-turn`` at a time.

    python bench/probe_serve_rows.py [--rows 200000] [--reps 300] [--out FILE]
    python bench/probe_serve_rows.py --tcp-client --daemon-env OMP_WAIT_POLICY=PASSIVE   # the daemon's environment only
"""

from __future__ import annotations

import argparse
import cProfile
import io
import mmap
import os
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import _interleaved, _spawn, _stop  # (this script's folder)

D, B = 128, 4096


def own_shm_table(table: Any) -> tuple[Any, Any, str]:
    """A copy of ``table`` in a shared-memory file of this process: ``(tensor, mapping, path)``."""
    import torch

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="tw-probe-rows-", dir=folder)
    nbytes = table.numel() * table.element_size()
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    view = torch.frombuffer(mm, dtype=table.dtype).view(table.shape)
    view.copy_(table)
    return view, mm, path


def faults_per_call(fn: Any, calls: int) -> tuple[float, float]:
    """``(minor, major)`` page faults of this process per call of ``fn`` over ``calls`` calls."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(calls):
        fn()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (r1.ru_minflt - r0.ru_minflt) / calls, (r1.ru_majflt - r0.ru_majflt) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the table (128 float32 each)")
    ap.add_argument("--batch", type=int, default=B, help="rows per get_rows")
    ap.add_argument("--reps", type=int, default=300, help="calls per path")
    ap.add_argument("--per-turn", type=int, default=20, help="calls of one path at a time")
    ap.add_argument("--profile-calls", type=int, default=300, help="client calls under cProfile (0: none)")
    ap.add_argument(
        "--tcp-client",
        action="store_true",
        help="also a client over the daemon's TCP data connection in this process, its get_rows a path of the turns "
        "(as in bench/bench_serve.py, where every client shares one process)",
    )
    ap.add_argument(
        "--gpu-client",
        action="store_true",
        help="also the client's get_rows into a CUDA tensor as a path of the turns (needs CUDA)",
    )
    ap.add_argument(
        "--daemon-env",
        default="",
        metavar="VAR=VALUE[,VAR=VALUE...]",
        help="environment variables set for the daemon only (the clients in this process keep this environment)",
    )
    ap.add_argument("--out", type=Path, default=None, help="markdown report")
    args = ap.parse_args()
    try:
        daemon_env = dict(kv.split("=", 1) for kv in args.daemon_env.split(",") if kv)
    except ValueError:
        ap.error(f"--daemon-env {args.daemon_env!r}: expected VAR=VALUE[,VAR=VALUE...]")
    if args.rows < 1 or args.batch < 1 or args.reps < 1 or args.per_turn < 1 or args.profile_calls < 0:
        ap.error("--rows, --batch, --reps and --per-turn must be >= 1, --profile-calls >= 0")
    import torch

    if args.gpu_client and not torch.cuda.is_available():
        ap.error("--gpu-client needs CUDA (torch.cuda.is_available() is False here)")

    import tensorwire as tw

    daemon, info = _spawn(
        [sys.executable, "-m", "tensorwire", "serve", "--port", "0", "--max-bytes", "8GiB"], **daemon_env
    )
    shm_path = ""
    try:
        client = tw.Client(f"127.0.0.1:{info['port']}", transport="shm", timeout=120)
        if client.data_path != "shm":
            raise SystemExit(f"the client's data path is {client.data_path!r}, not shared memory: nothing to probe")
        table = torch.randn(args.rows, D)
        client.put("table", table)
        gen = torch.Generator().manual_seed(0)
        idxs = [torch.randint(0, args.rows, (args.batch,), generator=gen) for _ in range(64)]
        out = torch.empty(args.batch, D)
        for i in range(8):  # (the first reads ask for the lease; later ones read from it)
            assert torch.equal(client.get_rows("table", idxs[i], out=out), table[idxs[i]])
        leased = client._mem.leased.get("table")
        if leased is None:
            raise SystemExit("the client holds no read lease on the table: the lease path is off here")
        own, _mapping, shm_path = own_shm_table(table)  # (mapped until the process ends; the file goes below)
        it = iter(range(10**12))

        def nxt() -> Any:
            return idxs[next(it) % 64]

        paths = {
            "client": lambda: client.get_rows("table", nxt(), out=out),
        }
        tcp = None
        if args.tcp_client:
            tcp = tw.Client(f"127.0.0.1:{info['port']}", transport="tcp", timeout=120)
            assert torch.equal(tcp.get_rows("table", idxs[0], out=out), table[idxs[0]])
            paths["tcp client"] = lambda: tcp.get_rows("table", nxt(), out=out)
        if args.gpu_client:
            out_gpu = torch.empty(args.batch, D, device="cuda")
            assert torch.equal(client.get_rows("table", idxs[0], out=out_gpu).cpu(), table[idxs[0]])

            def to_gpu() -> None:
                client.get_rows("table", nxt(), out=out_gpu)
                torch.cuda.synchronize()

            paths["client -> cuda"] = to_gpu
        paths |= {
            "leased view": lambda: torch.index_select(leased.table, 0, nxt(), out=out),
            "own shm": lambda: torch.index_select(own, 0, nxt(), out=out),
            "local": lambda: torch.index_select(table, 0, nxt(), out=out),
        }
        print(f"[probe] {len(paths)} paths in turns, {args.reps} calls each", file=sys.stderr, flush=True)
        res = _interleaved(paths, args.reps, warmup=5, per_turn=args.per_turn)
        faults = {k: faults_per_call(fn, min(args.reps, 50)) for k, fn in paths.items()}
        choice = client._mem.copier.choice
        prof_text = ""
        if args.profile_calls:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile_calls):
                client.get_rows("table", nxt(), out=out)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
            prof_text = buf.getvalue()
        threads = sorted(t.name for t in threading.enumerate())
        lease_reads = client.lease_reads
        client.close()
        if tcp is not None:
            tcp.close()
    finally:
        _stop(daemon)
        if shm_path:
            try:
                os.unlink(shm_path)
            except FileNotFoundError:
                pass
    nbytes = args.batch * D * 4
    lines = [
        "# A lease get_rows over shared memory, split (`bench/probe_serve_rows.py`)",
        "",
        f"{time.strftime('%Y-%m-%d', time.gmtime())}; {os.cpu_count()} CPUs; torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); table {args.rows:,} x {D} float32, {args.batch:,} random rows a call "
        f"({nbytes / 2**20:.1f} MiB); medians of {args.reps} calls per path, {args.per_turn} at a time, in turns.",
        f"Command: `python bench/probe_serve_rows.py --rows {args.rows} --batch {args.batch} --reps {args.reps}"
        + (" --tcp-client" if args.tcp_client else "")
        + (" --gpu-client" if args.gpu_client else "")
        + (f" --daemon-env {args.daemon_env}" if args.daemon_env else "")
        + "`.",
        "",
        "| path | median | GB/s | x local | page faults per call (minor / major) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, t in res.items():
        minor, major = faults[k]
        lines.append(
            f"| {k} | {t * 1e6:.1f} µs | {nbytes / t / 1e9:.2f} | {res['local'] / t:.2f}x | {minor:.1f} / {major:.1f} |"
        )
    lines += [
        "",
        f"The client's gather: {'torch' if choice.torch else 'numpy'} (last times per byte: numpy "
        f"{choice.cost[0] * 1e9:.3f} ns, torch {choice.cost[1] * 1e9:.3f} ns); {lease_reads} reads from the lease.",
        f"Threads in this process: {len(threads)} ({', '.join(threads)}).",
        f"The call outside its gather: {(res['client'] - res['leased view']) * 1e6:.1f} µs; the slot's pages against "
        f"torch's allocation: {(res['own shm'] - res['local']) * 1e6:.1f} µs.",
    ]
    if prof_text:
        lines += ["", f"`cProfile` of {args.profile_calls} client calls (most time of their own):", "", "```"]
        lines += [ln.rstrip() for ln in prof_text.strip().splitlines() if ln.strip()][:40]
        lines += ["```"]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
