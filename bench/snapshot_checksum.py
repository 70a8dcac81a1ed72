"""What the snapshot checksums cost: writing and restoring a store of SIZE bytes with and without them.

Each round writes (and then restores) the same store twice, in turns: once as the daemon does
(CRC-32 of every tensor as it is written, verified on restore), once with the checksum function
replaced by a no-op, everything else identical (temp file, fsync, read-back, rename). It also times
the checksum functions alone on the same bytes. Prints medians and the ratio with / without.

    python3 bench/snapshot_checksum.py --size 256MiB --tensors 4 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import zlib


def main() -> None:
    import torch

    import tensorwire.serve.daemon.snapshot as snapshot
    from tensorwire.serve.daemon.config import parse_size
    from tensorwire.serve.daemon.store import Store
    from tensorwire.spec import TensorSpec

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    size = parse_size(args.size)
    per = size // args.tensors // 4

    real_crc = zlib.crc32
    times: dict[str, list[float]] = {k: [] for k in ("write+crc", "write", "restore+verify", "restore")}
    with tempfile.TemporaryDirectory() as d:
        store = Store(4 * size)
        try:
            for i in range(args.tensors):
                t = torch.randn(per)
                store.restore(
                    TensorSpec(f"t{i}", (per,), "float32"), 1, lambda raw, t=t: raw.copy_(t.view(torch.uint8))
                )
            for _ in range(args.rounds):
                for crc_on in (True, False):
                    snapshot.zlib.crc32 = real_crc if crc_on else (lambda data, value=0: 0)  # type: ignore[misc]
                    try:
                        t0 = time.perf_counter()
                        snapshot.write_snapshot(store, d)
                        t1 = time.perf_counter()
                        fresh = Store(4 * size)
                        try:
                            snapshot.restore_snapshot(fresh, d)
                        finally:
                            fresh.close()
                        t2 = time.perf_counter()
                    finally:
                        snapshot.zlib.crc32 = real_crc  # type: ignore[misc]
                    times["write+crc" if crc_on else "write"].append(t1 - t0)
                    times["restore+verify" if crc_on else "restore"].append(t2 - t1)
        finally:
            store.close()
        data = memoryview(bytes(size))
        alone = {}
        for name, fn in (
            ("crc32 (zlib)", lambda: zlib.crc32(data)),
            ("blake2b-128", lambda: hashlib.blake2b(data, digest_size=16).digest()),
        ):
            runs = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            alone[name] = statistics.median(runs)

    med = {k: statistics.median(v) for k, v in times.items()}
    mib = size / (1 << 20)
    print(f"snapshot of {mib:.0f} MiB in {args.tensors} tensors, {args.rounds} rounds, medians (in turns):")
    print("| step | with CRC-32 | without | ratio |")
    print("| --- | ---: | ---: | ---: |")
    print(
        f"| write (temp file, fsync, read-back, rename) | {med['write+crc'] * 1e3:.0f} ms | {med['write'] * 1e3:.0f} ms "
        f"| {med['write+crc'] / med['write']:.2f}x |"
    )
    print(
        f"| restore (read, verify, fill) | {med['restore+verify'] * 1e3:.0f} ms | {med['restore'] * 1e3:.0f} ms "
        f"| {med['restore+verify'] / med['restore']:.2f}x |"
    )
    print()
    print("| checksum alone | time | rate |")
    print("| --- | ---: | ---: |")
    for name, dt in alone.items():
        print(f"| {name} | {dt * 1e3:.0f} ms | {size / dt / 1e9:.2f} GB/s |")


if __name__ == "__main__":
    main()
