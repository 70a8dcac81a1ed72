"""Benchmark backends: a registry of lazily imported sender/receiver pairs.

Each entry names a module of this package holding a ``Sender`` and a
``Receiver`` class (see :mod:`.base`). Modules import their dependency
(torch.distributed, grpc, ucxx, nixl) only when a pair is built.
"""

from __future__ import annotations

import importlib
from typing import Iterable

from tensorwire.errors import ConfigError

__all__ = ["BACKENDS", "ALIASES", "resolve", "load", "default_backends", "is_tensorwire", "GRPC"]

#: name -> (module, constructor argument, one-line description)
BACKENDS: dict[str, tuple[str, str | None, str]] = {
    "tensorwire-tcp": ("tw", "tcp", "tensorwire Node/Link, TCP transport"),
    "tensorwire-tcp-stream": (
        "tw",
        "tcp-stream",
        "as tensorwire-tcp with cross-memory attach off (TENSORWIRE_CMA=off): every byte over the socket",
    ),
    "tensorwire-ucx": ("tw", "ucx", "tensorwire Node/Link, UCX transport (ucxx)"),
    "tensorwire-ucx-isend": (
        "tw",
        "ucx-isend",
        "as tensorwire-ucx, the stream pattern through Link.isend: up to "
        "2 messages in flight (the receiver's slots per name), as torch-nccl's send returns "
        "once queued on a stream; round trips are the same as tensorwire-ucx",
    ),
    "tensorwire-ucx-isend4": (
        "tw",
        "ucx-isend4",
        "as tensorwire-ucx-isend with node.link(..., depth=4) on the receiver: up to 4 messages in flight",
    ),
    "grpc-unary": ("grpcb", "unary", "gRPC unary call carrying the bytes (limits raised), response = ack"),
    "grpc-stream": ("grpcb", "stream", "gRPC client-streaming in chunks into a preallocated buffer"),
    "raw-tcp": ("rawtcp", None, "plain TCP socket: sendall / recv_into, 1-byte ack"),
    "raw-ucxx": (
        "rawucx",
        None,
        "ucxx core API tag send/recv, polling progress, endpoints by worker address (shared memory + cma on one host)",
    ),
    "raw-ucxx-cm": (
        "rawucx",
        "cm",
        "as raw-ucxx, connected through a UCX listener (sockaddr CM, peer error "
        "handling): what ucxx.create_listener and tensorwire's UCX transport do",
    ),
    "raw-ucxx-cmnoerr": ("rawucx", "cmnoerr", "as raw-ucxx-cm, endpoints without peer error handling"),
    "raw-ucxx-2buf": (
        "rawucx",
        "2buf",
        "as raw-ucxx, the receiver alternating two buffers (a double-buffered receiver; a Link's default "
        "depth): the same memory footprint as tensorwire-ucx's receiver",
    ),
    "torch-gloo": ("torchdist", "gloo", "torch.distributed send/recv, gloo (CPU)"),
    "torch-nccl": ("torchdist", "nccl", "torch.distributed send/recv, NCCL (CUDA)"),
    "nixl": ("nixlb", None, "NIXL one-sided WRITE + notification (UCX backend), when importable"),
}

GRPC = ("grpc-unary", "grpc-stream")

ALIASES: dict[str, tuple[str, ...]] = {
    "tensorwire": ("tensorwire-tcp", "tensorwire-ucx"),
    "grpc": GRPC,
    "raw": ("raw-tcp", "raw-ucxx", "raw-ucxx-cm"),
}


def is_tensorwire(name: str) -> bool:
    return name.startswith("tensorwire-")


def default_backends(device: str) -> tuple[str, ...]:
    torch_b = "torch-nccl" if device == "cuda" else "torch-gloo"
    return (
        "tensorwire-tcp",
        "tensorwire-ucx",
        "grpc-unary",
        "grpc-stream",
        "raw-tcp",
        "raw-ucxx",
        "raw-ucxx-cm",
        torch_b,
        "nixl",
    )


def resolve(names: Iterable[str], *, device: str) -> tuple[str, ...]:
    """Expand aliases (``all``, ``tensorwire``, ``grpc``, ``raw``, ``torch``), keep order, drop duplicates.

    Raises:
        ConfigError: an unknown name.
    """
    out: list[str] = []
    for raw in names:
        for name in (n.strip() for n in raw.split(",")):
            if not name:
                continue
            if name == "all":
                expanded: tuple[str, ...] = default_backends(device)
            elif name == "torch":
                expanded = ("torch-nccl" if device == "cuda" else "torch-gloo",)
            elif name in ALIASES:
                expanded = ALIASES[name]
            elif name in BACKENDS:
                expanded = (name,)
            else:
                raise ConfigError(
                    f"unknown backend {name!r}; known: all, {', '.join(sorted(ALIASES))}, torch, {', '.join(BACKENDS)}"
                )
            out.extend(b for b in expanded if b not in out)
    if not out:
        raise ConfigError("no backend selected")
    return tuple(out)


def load(name: str):
    """(SenderClass, ReceiverClass, argument) of a backend (imports its module, not its dependency)."""
    module, arg, _ = BACKENDS[name]
    mod = importlib.import_module(f"{__name__}.{module}")
    return mod.Sender, mod.Receiver, arg
