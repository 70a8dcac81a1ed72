"""Settings: one place, one precedence, validated once; docs/configuration.md is generated from it."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from tensorwire.errors import ConfigError
from tensorwire.settings import DEFAULT_STAGING_CHUNK, Settings, env_var, parse_size, setting

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def test_defaults_when_the_environment_is_empty():
    s = Settings.from_env({})
    assert s == Settings()
    assert (s.transport, s.timeout, s.peer_timeout, s.staging_chunk) == ("auto", 60.0, 30.0, DEFAULT_STAGING_CHUNK)
    assert s.shm_leases is True and s.host is None


def test_keyword_beats_environment_beats_default():
    env = {"TENSORWIRE_TIMEOUT": "5", "TENSORWIRE_PEER_TIMEOUT": "7", "TENSORWIRE_TRANSPORT": " TCP "}
    s = Settings.from_env(env, peer_timeout=10.0, transport=None)  # None = not given
    assert (s.timeout, s.peer_timeout, s.transport) == (5.0, 10.0, "tcp")
    assert Settings.from_env({"TENSORWIRE_TIMEOUT": ""}).timeout == 60.0  # empty = unset


def test_every_field_reads_its_own_variable():
    for f in dataclasses.fields(Settings):
        assert env_var(f.name) == "TENSORWIRE_" + f.name.upper()
    env = {
        "TENSORWIRE_STAGING_CHUNK": "512KiB",
        "TENSORWIRE_SHM_AHEAD": "off",
        "TENSORWIRE_UCX_SPIN_US": "0",
        "TENSORWIRE_AUTO_PREFER": "ucx",
        "TENSORWIRE_LOG_LEVEL": "debug",
        "TENSORWIRE_HOST": " 10.0.0.2 ",
    }
    s = Settings.from_env(env)
    assert (s.staging_chunk, s.shm_ahead, s.ucx_spin_us, s.auto_prefer, s.log_level, s.host) == (
        512 << 10,
        False,
        0.0,
        "ucx",
        "DEBUG",
        "10.0.0.2",
    )


@pytest.mark.parametrize(
    "var, raw",
    [
        ("TENSORWIRE_TIMEOUT", "soon"),
        ("TENSORWIRE_TIMEOUT", "0"),
        ("TENSORWIRE_PEER_TIMEOUT", "inf"),
        ("TENSORWIRE_PEER_TIMEOUT", "nan"),
        ("TENSORWIRE_TRANSPORT", "rdma"),
        ("TENSORWIRE_AUTO_PREFER", "fastest"),
        ("TENSORWIRE_STAGING_CHUNK", "1.5M"),
        ("TENSORWIRE_STAGING_CHUNK", "-1"),
        ("TENSORWIRE_UCX_SPIN_US", "-3"),
        ("TENSORWIRE_TCP_SPIN_US", "abc"),
        ("TENSORWIRE_TCP_SPIN_US", "1e9"),  # a thousand seconds of polling: a unit mistake
        ("TENSORWIRE_UCX_ERROR_HANDLING", "sometimes"),
        ("TENSORWIRE_SHM_LEASES", "maybe"),
        ("TENSORWIRE_LOG_LEVEL", "LOUD"),
    ],
)
def test_an_invalid_variable_is_a_config_error_naming_it_and_its_value(var, raw):
    with pytest.raises(ConfigError, match=re.escape(f"{var}={raw!r}")):
        Settings.from_env({var: raw})
    with pytest.raises(ConfigError, match=re.escape(var)):
        setting(var.removeprefix("TENSORWIRE_").lower(), {var: raw})


def test_keywords_are_validated_like_the_environment():
    with pytest.raises(ConfigError, match="timeout"):
        Settings(timeout=-1.0)
    with pytest.raises(ConfigError, match="transport"):
        Settings.from_env({}, transport="carrier-pigeon")
    with pytest.raises(ConfigError, match="unknown settings"):
        Settings.from_env({}, timeuot=3.0)
    assert Settings(timeout=3).timeout == 3.0 and isinstance(Settings(timeout=3).timeout, float)


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("raw, want", [("0", 0), ("7b", 7), ("4M", 4 << 20), (" 2 MB ", 2 << 20), ("1g", 1 << 30)])
def test_sizes(raw, want):
    assert parse_size(raw) == want


def test_docs_configuration_md_is_generated_from_the_code():
    from tensorwire.configdoc import render

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: python -m tensorwire.configdoc > docs/configuration.md"
    )


def test_every_variable_the_package_names_is_documented():
    """A TENSORWIRE_* variable read anywhere in tensorwire/ appears in docs/configuration.md."""
    doc = (ROOT / "docs" / "configuration.md").read_text()
    named = set()
    for path in (ROOT / "tensorwire").rglob("*.py"):
        named |= set(re.findall(r"TENSORWIRE_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()))
    named -= {"TENSORWIRE_X_Y"}
    missing = sorted(v for v in named if f"`{v}`" not in doc)
    assert not missing, f"TENSORWIRE_* variables named in the package but not documented: {missing}"
