"""``tensorwire bench``: the same bytes through tensorwire and its peers, one run, one table.

Every backend moves the same messages between two processes (spawned fresh
for each backend, so nothing one backend leaves behind disturbs the next):
rank 0 sends and times, rank 1 receives (into memory allocated once per
message size) and acknowledges. Two patterns:

- ``uni``: a stream of sends, one small ack at the end (throughput);
- ``rtt``: one-way send + a small ack, repeated (latency; its throughput is
  the ANCHORS figure: size / median round trip).

Backends (:data:`tensorwire.benchmark.backends.BACKENDS`): tensorwire over UCX
and over TCP (real :class:`tensorwire.Node` / :class:`tensorwire.Link`), gRPC
unary and gRPC client-streaming, a raw TCP socket, raw ucxx (core API,
polling progress), torch.distributed (gloo on CPU, NCCL on GPU) and NIXL when
importable. A backend that fails is reported as failed, never a crash.

Layout:

- :mod:`.config`: :class:`BenchConfig`, sizes and iteration counts (pure Python);
- :mod:`.backends`: one module per backend, a common two-sided interface;
- :mod:`.worker`: what each spawned process runs (the driver loops, ``--check``);
- :mod:`.runner`: spawns the pairs, bounds them in time, collects results;
- :mod:`.memcheck`: 1,000 steps through a Link allocate nothing after the first;
- :mod:`.figures`: figures, ratios and target verdicts from the raw timings;
- :mod:`.report`: table (OSU/nccl-tests style), markdown, JSON, CSV, PNG;
- :mod:`.environment`: CPU/GPU/topology/versions/effective ``UCX_*``;
- :mod:`.cli`: ``tensorwire bench`` (argument parsing only).

Nothing heavy is imported at module level.
"""

from __future__ import annotations

from tensorwire.benchmark.config import BenchConfig, default_sizes, schedule

__all__ = ["BenchConfig", "default_sizes", "schedule"]
