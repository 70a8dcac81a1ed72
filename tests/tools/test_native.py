"""The compiled hot path: setup.py's choice and configuration, tensorwire.native's report, doctor's finding.

The compiled modules themselves are tested by running the suite against a build
of them (``make native-test``, which CI runs); here: what decides and reports it.
"""

from __future__ import annotations

import configparser
import pathlib
import runpy
import sys

import pytest
import setuptools

from tensorwire import doctor, native
from tensorwire.doctor.checks import check_native
from tensorwire.doctor.probe import Probe

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def setup_py(monkeypatch):
    """setup.py's namespace, run without building anything (``setuptools.setup`` recorded, not called)."""
    calls: list[dict] = []
    monkeypatch.setattr(setuptools, "setup", lambda **kw: calls.append(kw))
    ns = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")
    assert len(calls) == 1
    ns["setup_kwargs"] = calls[0]
    return ns


def test_setup_compiles_exactly_the_modules_tensorwire_native_lists(setup_py):
    assert setup_py["native_modules"]() == list(native.MODULES)
    kw = setup_py["setup_kwargs"]
    assert kw["cmdclass"]["build_ext"] is setup_py["BuildNative"]
    assert kw["distclass"]().has_ext_modules()  # build_ext always runs, and decides
    for name in native.MODULES:
        assert (ROOT / pathlib.Path(*name.split("."))).with_suffix(".py").is_file(), name


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("", "auto"), ("auto", "auto"), ("1", "on"), ("yes", "on"), ("0", "off"), ("OFF", "off")],
)
def test_tensorwire_native_values(setup_py, monkeypatch, raw, mode):
    monkeypatch.setenv("TENSORWIRE_NATIVE", raw)
    assert setup_py["native_mode"]() == mode


def test_a_bad_tensorwire_native_stops_the_install_naming_it(setup_py, monkeypatch):
    monkeypatch.setenv("TENSORWIRE_NATIVE", "maybe")
    with pytest.raises(SystemExit, match="TENSORWIRE_NATIVE='maybe': expected auto, 1 or 0"):
        setup_py["native_mode"]()


def test_mypyc_gets_the_projects_mypy_settings_without_files_and_unused_config_warnings(setup_py, tmp_path):
    ini = configparser.ConfigParser()
    ini.read(setup_py["mypy_config"](tmp_path))
    assert ini["mypy"]["python_version"] == "3.11" and ini["mypy"]["ignore_missing_imports"] == "True"
    assert "files" not in ini["mypy"]
    # mypyc stops on any message, and pip's build environment has no torch or numpy: a `type: ignore` needed
    # with them is unused there, and the modules it does not compile are read for their types only
    assert ini["mypy"]["warn_unused_configs"] == ini["mypy"]["warn_unused_ignores"] == "False"
    assert ini["mypy"]["follow_imports"] == "silent"
    assert ini["mypy-torch,torch.*"]["follow_imports"] == "skip"
    assert ini["mypy-tensorwire.v1.*"]["ignore_errors"] == "True"


def test_status_tells_compiled_from_python_and_missing_modules(monkeypatch):
    # _socket is an extension module of the interpreter where it is built shared (most Linux builds)
    ext = "_socket" if getattr(sys.modules.get("_socket"), "__file__", "").endswith(".so") else None
    names = ("json.decoder", "tensorwire.no_such_module") + ((ext,) if ext else ())
    monkeypatch.setattr(native, "MODULES", names)
    got = native.status()
    assert got["json.decoder"] == "python" and got["tensorwire.no_such_module"] == "missing"
    if ext:
        assert got[ext] == "compiled"
    assert native.compiled() is False
    assert native.summary() == ("partly compiled (1/3 modules)" if ext else "pure Python")
    monkeypatch.setattr(native, "MODULES", ("json.decoder",))
    assert native.summary() == "pure Python"
    if ext:
        monkeypatch.setattr(native, "MODULES", (ext,))
        assert native.compiled() is True and native.summary() == "compiled (1/1 modules)"


def test_this_checkout_is_pure_python():
    """The suite runs from the source tree, where nothing is compiled (``make native-test`` runs it compiled)."""
    if "compiled" in native.status().values():
        pytest.skip("running against a compiled build")
    assert set(native.status().values()) == {"python"}


@pytest.mark.parametrize(
    ("kinds", "verdict", "words"),
    [
        ({"a": "compiled", "b": "compiled"}, "OK", "compiled by mypyc (2/2 modules)"),
        ({"a": "python", "b": "python"}, "WARN", "pure Python"),
        ({"a": "compiled", "b": "python"}, "WARN", "partly compiled (1/2 modules); Python: b"),
    ],
)
def test_doctor_says_which_hot_path_is_installed(monkeypatch, kinds, verdict, words):
    monkeypatch.setattr(native, "status", lambda: dict(kinds))
    (f,) = check_native(Probe(root="/nonexistent", env={}))
    assert f.check == "hot path" and f.verdict == verdict and words in f.detail
    assert (f.fix == "") == (verdict == "OK")
    if f.fix:
        assert "TENSORWIRE_NATIVE=1 pip install" in f.fix
        assert "TENSORWIRE_NATIVE=1 pip wheel --no-deps" in f.fix  # a host without a compiler: a wheel from elsewhere
    assert check_native in doctor.CHECKS


def test_a_build_that_fails_part_way_leaves_no_compiled_module_in_the_package(setup_py, tmp_path, monkeypatch, capsys):
    """Compiled and Python modules of one mypyc group would each hold their own classes: after a failure
    (auto mode) what was built is removed, and the package installs as Python."""
    from setuptools import Extension

    cmd = setup_py["BuildNative"](setup_py["BinaryDistribution"]({"name": "x"}))
    cmd._mode = "auto"
    cmd.build_lib = str(tmp_path)
    cmd.extensions = [Extension("tensorwire__mypyc", ["a.c"]), Extension("tensorwire.transport.tcp.wire", ["b.c"])]
    built = [pathlib.Path(cmd.get_ext_fullpath(e.name)) for e in cmd.extensions]

    def half_built(self):
        built[0].parent.mkdir(parents=True, exist_ok=True)
        built[0].write_bytes(b"\x7fELF")  # the first one made it, the second did not
        raise RuntimeError("gcc failed on the second")

    monkeypatch.setattr(setup_py["build_ext"], "run", half_built)
    cmd.run()
    assert not any(p.exists() for p in built) and cmd.extensions == []
    assert "the compiled hot path was not built (RuntimeError: gcc failed on the second)" in capsys.readouterr().err
    cmd._mode = "on"  # TENSORWIRE_NATIVE=1: the same failure stops the install
    cmd.extensions = [Extension("tensorwire__mypyc", ["a.c"])]
    with pytest.raises(RuntimeError, match="gcc failed"):
        cmd.run()
