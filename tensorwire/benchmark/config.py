"""Benchmark configuration and the iteration schedule both sides of a pair follow.

Pure Python: imported by ``tensorwire bench --help``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from tensorwire.errors import ConfigError

__all__ = [
    "BenchConfig",
    "Steps",
    "schedule",
    "default_sizes",
    "parse_size",
    "format_size",
    "PATTERNS",
    "DEFAULT_MAX_SIZE_CPU",
    "DEFAULT_MAX_SIZE_CUDA",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PATTERNS = ("uni", "rtt")
DEFAULT_MIN_SIZE = 4 * KiB
#: Default largest message on CPU: fits the 2-core CI box in a few minutes.
DEFAULT_MAX_SIZE_CPU = 256 * MiB
DEFAULT_MAX_SIZE_CUDA = 1 * GiB
#: Bytes a round-trip / unidirectional phase aims to move at scale 1 (bounds large sizes).
RTT_BYTES = 256 * MiB
UNI_BYTES = 512 * MiB
MAX_RTT_ITERS = 1000
MAX_UNI_MSGS = 2000
MIN_RTT_ITERS = 5
UNI_REPS = 3


def parse_size(text: str) -> int:
    """``"4K"``, ``"4KiB"``, ``"16M"``, ``"1G"``, ``"4096"`` -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if s and s[-1] in "KMG":
        mult = {"K": KiB, "M": MiB, "G": GiB}[s[-1]]
        s = s[:-1]
    try:
        value = int(float(s) * mult)
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (examples: 4K, 16M, 1G)") from None
    if value <= 0:
        raise ConfigError(f"size must be > 0, got {text!r}")
    return value


def format_size(n: int) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def default_sizes(min_size: int = DEFAULT_MIN_SIZE, max_size: int = DEFAULT_MAX_SIZE_CPU) -> tuple[int, ...]:
    """Powers of two from ``min_size`` (rounded up) to ``max_size`` (inclusive)."""
    if min_size < 16:
        raise ConfigError(f"--min-size must be at least 16 bytes (the --check stamps), got {min_size}")
    if max_size < min_size:
        raise ConfigError(f"--max-size {max_size} is below --min-size {min_size}")
    size = 1 << (min_size - 1).bit_length()
    out = []
    while size <= max_size:
        out.append(size)
        size <<= 1
    if not out:
        raise ConfigError(f"no power of two between {min_size} and {max_size}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Steps:
    """What both sides of a pair do for one message size, in this order.

    1. ``first``: one round trip on freshly allocated buffers (timed alone: the
       first transfer pays registration / page faults);
    2. ``warmup`` round trips (not timed);
    3. each pattern of the config: ``uni`` = ``uni_reps`` timed batches of
       ``uni_batch`` sends then one ack; ``rtt`` = ``rtt_iters`` timed round trips.
    """

    size: int
    warmup: int
    rtt_iters: int
    uni_reps: int
    uni_batch: int

    def messages(self, pattern: str) -> int:
        return self.uni_reps * self.uni_batch if pattern == "uni" else self.rtt_iters


def _clamp(x: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, x)))


def schedule(size: int, *, scale: float = 1.0) -> Steps:
    """Iteration counts for ``size``: many small messages, fewer above 1 MiB (byte budget).

    ``scale`` multiplies every count (tests use ~0.02; floors keep p50/p99 meaningful).
    """
    lo_rtt = MIN_RTT_ITERS if scale >= 1 else 2
    rtt = _clamp(scale * min(MAX_RTT_ITERS, RTT_BYTES / size), lo_rtt, MAX_RTT_ITERS * 100)
    uni_total = _clamp(
        scale * min(MAX_UNI_MSGS, UNI_BYTES / size), 2 * UNI_REPS if scale >= 1 else UNI_REPS, MAX_UNI_MSGS * 100
    )
    warmup = _clamp(rtt / 10, 1, 50)
    return Steps(size=size, warmup=warmup, rtt_iters=rtt, uni_reps=UNI_REPS, uni_batch=max(1, uni_total // UNI_REPS))


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything both processes of a pair need to run the same plan.

    Attributes:
        backends: resolved backend names, in run order.
        sizes: message sizes in bytes.
        patterns: subset of ``("uni", "rtt")``.
        device: where buffers live on both sides ("cpu" or "cuda"; rank r uses cuda:r when there are 2 GPUs).
        check: verify every received buffer bit-exact (timings then include the check).
        iters_scale: multiplies iteration counts (see :func:`schedule`).
        timeout: seconds one backend may take (both processes) before it is killed and reported failed.
        op_timeout: seconds one send/recv may take inside a backend.
        host: address the receiver binds (loopback by default).
        grpc_chunk: chunk size of the gRPC client-streaming backend.
        inject_corruption: a backend whose sender flips one byte of one message (tests ``--check``).
        grpc_max_size: gRPC backends stop at this size (they take seconds per message on a GPU host).
        memcheck: run the 1,000-step Link memory check after the backends.
        memcheck_steps / memcheck_size: its length and message size.
    """

    backends: tuple[str, ...]
    sizes: tuple[int, ...]
    patterns: tuple[str, ...] = PATTERNS
    device: Literal["cpu", "cuda"] = "cpu"
    check: bool = False
    iters_scale: float = 1.0
    timeout: float | None = None
    op_timeout: float = 120.0
    host: str = "127.0.0.1"
    grpc_chunk: int = 1 * MiB
    inject_corruption: str | None = None
    grpc_max_size: int | None = None
    memcheck: bool = True
    memcheck_steps: int = 1000
    memcheck_size: int = 1 * MiB

    def __post_init__(self) -> None:
        if not self.backends:
            raise ConfigError("no backend to run")
        if not self.sizes or any(s < 16 for s in self.sizes):
            raise ConfigError(f"sizes must be >= 16 bytes, got {self.sizes}")
        bad = [p for p in self.patterns if p not in PATTERNS]
        if bad or not self.patterns:
            raise ConfigError(f"patterns must be among {PATTERNS}, got {self.patterns}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.iters_scale <= 0:
            raise ConfigError(f"--iters-scale must be > 0, got {self.iters_scale}")
        if self.grpc_chunk < 1024:
            raise ConfigError(f"--grpc-chunk must be >= 1 KiB, got {self.grpc_chunk}")
        if self.memcheck_steps < 2:
            raise ConfigError("memcheck needs at least 2 steps")

    def for_backend(self, name: str) -> "BenchConfig":
        """The config one backend runs with (gRPC capped at ``grpc_max_size``)."""
        if self.grpc_max_size is not None and name.startswith("grpc"):
            sizes = tuple(s for s in self.sizes if s <= self.grpc_max_size) or self.sizes[:1]
            return dataclasses.replace(self, sizes=sizes)
        return self

    def steps(self) -> list[Steps]:
        return [schedule(s, scale=self.iters_scale) for s in self.sizes]

    def backend_timeout(self) -> float:
        """Explicit ``timeout``, else a bound from the bytes moved at a pessimistic 50 MB/s."""
        if self.timeout is not None:
            return self.timeout
        total = 0
        for st in self.steps():
            n = 1 + st.warmup + sum(st.messages(p) for p in self.patterns)
            total += n * st.size
        return 90.0 + total / 50e6

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchConfig":
        d = dict(d)
        for k in ("backends", "sizes", "patterns"):
            d[k] = tuple(d[k])
        return cls(**d)
