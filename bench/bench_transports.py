#!/usr/bin/env python3
"""Thin wrapper: ``python bench/bench_transports.py ARGS`` == ``tensorwire bench ARGS``.

Works from a checkout without installing the package. See ``tensorwire bench --help``
and bench/results/README.md for how the committed figures were made.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tensorwire.benchmark.cli import DESCRIPTION, EPILOG, add_arguments, run

    parser = argparse.ArgumentParser(
        prog="bench_transports.py",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args(), argv=sys.argv[1:]))
