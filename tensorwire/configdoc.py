"""``python -m tensorwire.configdoc > docs/configuration.md``: the configuration reference, from the code.

The library's variables come from :class:`tensorwire.settings.Settings`; the serve daemon's
from the ``tensorwire serve`` flags (each names its ``TENSORWIRE_*`` variable and default).
``tests/core/test_settings.py`` checks that the committed file is what this prints.
"""

from __future__ import annotations

import argparse
import re
import sys

from tensorwire.serve.cli import add_serve_arguments
from tensorwire.serve.daemon.config import ENV_PREFIX
from tensorwire.settings import markdown

__all__ = ["serve_rows", "render", "main"]

_ENV = re.compile(r"\s*\((?:default (?P<default>.*?); )?env (?P<var>TENSORWIRE_[A-Z_]+)\)$")


def serve_rows() -> dict[str, tuple[str, str]]:
    """``TENSORWIRE_X`` -> (default, meaning) for every flag of ``tensorwire serve`` that has a variable."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    rows: dict[str, tuple[str, str]] = {}
    for action in parser._actions:
        text = " ".join((action.help or "").split())
        if not action.option_strings or action.dest == "help":
            continue
        m = _ENV.search(text)
        var = m.group("var") if m else ENV_PREFIX + action.dest.upper()
        default = f"`{m.group('default')}`" if m and m.group("default") else "unset"
        meaning = (text[: m.start()] if m else text).replace("|", "\\|")
        rows[var] = (default, f"{meaning} (`{max(action.option_strings, key=len)}`)")
    return rows


def render() -> str:
    """The text of ``docs/configuration.md``."""
    return markdown(serve_rows())


def main(argv: list[str] | None = None) -> int:
    if sys.argv[1:] if argv is None else argv:
        sys.stderr.write("usage: python -m tensorwire.configdoc > docs/configuration.md\n")
        return 2
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
