"""Build hook: compile tensorwire's hot path with mypyc where possible (see ``tensorwire/native.py``).

Everything else about the package is in ``pyproject.toml``. The modules to
compile are listed in ``tensorwire/native.py`` (read here as text: the package
is not imported). ``TENSORWIRE_NATIVE`` (``auto`` by default, ``1``, ``0``)
decides; in ``auto`` a failed compile (no C compiler, no Python headers)
installs the pure-Python modules with a warning, and an editable install
compiles nothing.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import tempfile
import tomllib
from typing import Any

from setuptools import Distribution, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


def native_modules() -> list[str]:
    """``MODULES`` of tensorwire/native.py, as a literal (the package is not imported)."""
    tree = ast.parse((ROOT / "tensorwire" / "native.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["MODULES"]:
            return list(ast.literal_eval(node.value))
    raise RuntimeError("tensorwire/native.py defines no MODULES")


def native_mode() -> str:
    raw = os.environ.get("TENSORWIRE_NATIVE", "auto").strip().lower()
    if raw in ("", "auto"):
        return "auto"
    if raw in ("1", "on", "true", "yes"):
        return "on"
    if raw in ("0", "off", "false", "no"):
        return "off"
    raise SystemExit(f"TENSORWIRE_NATIVE={raw!r}: expected auto, 1 or 0")


def _ini_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


#: What the build changes in the project's mypy settings. mypyc stops on any message, and the build runs where
#: the type check of ``make check`` does not: pip's isolated build environment has neither torch nor numpy, so
#: a ``type: ignore`` needed with them is unused without them. So: no ``files`` (mypyc names its modules), no
#: warnings about the configuration or unused ignores, and the modules it does not compile are read for their
#: types only (``follow_imports = silent``: their findings are ``make check``'s).
MYPYC_SETTINGS = {"warn_unused_configs": False, "warn_unused_ignores": False, "follow_imports": "silent"}


def mypy_config(into: pathlib.Path) -> pathlib.Path:
    """The project's mypy settings (pyproject's ``[tool.mypy]``) as an ini file for mypyc (see
    :data:`MYPYC_SETTINGS`)."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    lines = ["[mypy]"]
    for key, value in {**conf, **MYPYC_SETTINGS}.items():
        if key not in ("overrides", "files"):
            lines.append(f"{key} = {_ini_value(value)}")
    for override in conf.get("overrides", []):
        mods = override["module"]
        lines.append(f"[mypy-{','.join(mods) if isinstance(mods, list) else mods}]")
        lines += [f"{k} = {_ini_value(v)}" for k, v in override.items() if k != "module"]
    path = into / "mypyc.ini"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class BinaryDistribution(Distribution):
    """A distribution that may hold compiled modules: ``build_ext`` always runs (and decides)."""

    def has_ext_modules(self) -> bool:
        return True


class BuildNative(build_ext):
    """``build_ext`` that compiles :func:`native_modules` with mypyc, or nothing (see the module docstring)."""

    def finalize_options(self) -> None:
        self._mode = native_mode()
        editable = bool(self.editable_mode) or bool(self.inplace)
        if not self.distribution.ext_modules and (self._mode == "on" or (self._mode == "auto" and not editable)):
            self.distribution.ext_modules = self._mypycify()
        super().finalize_options()

    def _mypycify(self) -> list[Any]:
        """The compiled modules' extensions (mypyc type-checks and writes their C here), or none."""
        try:
            from mypyc.build import mypycify

            paths = [str(pathlib.Path(*m.split("."))) + ".py" for m in native_modules()]
            with tempfile.TemporaryDirectory() as tmp:
                config = mypy_config(pathlib.Path(tmp))
                return list(mypycify(["--config-file", str(config), *paths], opt_level="3", group_name="tensorwire"))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - auto mode falls back to pure Python, loudly
            self._fallback(exc)
            return []

    def run(self) -> None:
        try:
            super().run()
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - e.g. no C compiler or no Python.h
            # None of what was built goes into the package: compiled and Python modules of the same group
            # would each hold their own classes.
            for ext in self.extensions:
                pathlib.Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
            self._fallback(exc)

    def _fallback(self, exc: BaseException) -> None:
        if self._mode == "on":
            raise exc
        print(
            f"tensorwire: the compiled hot path was not built ({type(exc).__name__}: {exc}); "
            "installing the pure-Python modules (same behaviour, more CPU per message). "
            "TENSORWIRE_NATIVE=1 makes this an error.",
            file=sys.stderr,
        )
        self.extensions = []


setup(distclass=BinaryDistribution, cmdclass={"build_ext": BuildNative})
