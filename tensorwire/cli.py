"""``tensorwire`` command line: parses arguments and calls into the package.

Subcommands live beside the code they run; each module named in
:data:`COMMAND_MODULES` has a ``register(subparsers)`` function that adds its
subcommands and sets ``func`` (called with the parsed namespace, returning an
exit code). Those modules import nothing heavy at module level, so
``tensorwire --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from tensorwire import __version__
from tensorwire.settings import setting

COMMAND_MODULES = (
    "tensorwire.serve.cli",  # serve, ls, get, put
    "tensorwire.benchmark.cli",  # bench
    "tensorwire.doctor",  # doctor
    "tensorwire.demo",  # demo (the main job on an embedded default)
)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorwire",
        description="RDMA-aware tensor exchange for PyTorch: UCX/TCP data plane, gRPC control plane.",
    )
    parser.add_argument("--version", action="version", version=f"tensorwire {__version__}")
    parser.add_argument(
        "--log-level", default=None, help="DEBUG, INFO, WARNING (default), ERROR; env TENSORWIRE_LOG_LEVEL"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # a feature whose optional dependency is missing
            if exc.name and exc.name.startswith("tensorwire"):
                continue
            raise
        module.register(sub)
    return parser


def configure_logging(level: str | None) -> None:
    level = (level or setting("log_level") or "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    configure_logging(args.log_level)
    from tensorwire.errors import TensorWireError

    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except TensorWireError as exc:
        print(f"tensorwire: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
