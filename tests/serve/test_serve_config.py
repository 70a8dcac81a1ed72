"""ServeConfig validation, SIZE parsing, flag > env > default precedence, and the refusals of the CLI."""

from __future__ import annotations

import pytest

from tensorwire.errors import ConfigError
from tensorwire.serve.daemon.config import ServeConfig, TLSConfig, is_loopback, parse_size

from serve_common import run_cli


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text, value",
    [
        ("64GiB", 64 << 30),
        ("500MB", 500 * 10**6),
        ("4096", 4096),
        ("1.5g", int(1.5 * (1 << 30))),
        ("2 KiB", 2048),
        ("10kb", 10_000),
        ("7b", 7),
        (123, 123),
    ],
)
def test_parse_size_accepts_units_and_plain_bytes(text, value):
    assert parse_size(text) == value


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text", ["", "GiB", "-1", "0", "12XB", "1e9", "one", True])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.timeout(10)
def test_defaults_are_loopback_7100_auto():
    c = ServeConfig()
    assert (c.host, c.port, c.data_port, c.transport) == ("127.0.0.1", 7100, 0, "auto")
    assert c.max_bytes > 0 and not c.insecure and c.metrics_port is None
    with pytest.raises(dataclass_frozen_error()):
        c.port = 1  # type: ignore[misc]


def dataclass_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"port": 70000}, "port"),
        ({"data_port": -1}, "data_port"),
        ({"transport": "rdma"}, "transport"),
        ({"max_bytes": "lots"}, "size"),
        ({"tls_cert": "/nonexistent"}, "tls-cert"),
        ({"tls_ca": __file__}, "--tls-ca"),
        ({"token_file": "/nonexistent/token"}, "token file"),
        ({"drain_timeout": 0}, "drain_timeout"),
    ],
)
def test_invalid_configs_are_refused_with_a_clear_message(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        ServeConfig(**{"port": 0, **kwargs})


@pytest.mark.timeout(10)
def test_non_loopback_bind_requires_token_tls_or_insecure(tmp_path):
    with pytest.raises(ConfigError, match="not a loopback address.*--token-file.*--insecure"):
        ServeConfig(host="0.0.0.0", port=0)
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    assert ServeConfig(host="0.0.0.0", port=0, token_file=str(token)).load_token() == "s3cret-token-of-enough-length"
    assert ServeConfig(host="0.0.0.0", port=0, insecure=True).insecure
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        ServeConfig(port=0, token_file=str(empty))


@pytest.mark.timeout(10)
def test_is_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("8.8.8.8")


@pytest.mark.timeout(10)
def test_precedence_flag_over_env_over_default():
    env = {
        "TENSORWIRE_PORT": "7200",
        "TENSORWIRE_MAX_BYTES": "2GiB",
        "TENSORWIRE_TRANSPORT": "tcp",
        "TENSORWIRE_INSECURE": "yes",
        "TENSORWIRE_DRAIN_TIMEOUT": "3.5",
    }
    c = ServeConfig.resolve({"port": 7300, "max_bytes": None}, env)
    assert c.port == 7300  # flag wins
    assert c.max_bytes == 2 << 30 and c.transport == "tcp" and c.insecure and c.drain_timeout == 3.5  # env
    assert c.host == "127.0.0.1" and c.data_port == 0  # defaults
    with pytest.raises(ConfigError, match="TENSORWIRE_PORT"):
        ServeConfig.resolve({}, {"TENSORWIRE_PORT": "seventy"})
    with pytest.raises(ConfigError, match="TENSORWIRE_INSECURE"):
        ServeConfig.resolve({}, {"TENSORWIRE_INSECURE": "maybe"})


@pytest.mark.timeout(10)
def test_tls_config_from_dict_and_errors(tmp_path):
    f = tmp_path / "ca.pem"
    f.write_text("x")
    assert TLSConfig.coerce({"ca": str(f)}).ca == str(f)
    assert TLSConfig.coerce(None) is None and TLSConfig.coerce(True) == TLSConfig()
    with pytest.raises(ConfigError, match="unknown keys"):
        TLSConfig.coerce({"cafile": str(f)})
    with pytest.raises(ConfigError, match="together"):
        TLSConfig(cert=str(f))


@pytest.mark.timeout(60)
def test_cli_help_states_env_precedence_and_refuses_public_bind_without_auth():
    r = run_cli("serve", "--help")
    assert r.returncode == 0
    assert "TENSORWIRE_PORT" in r.stdout and "flag > environment variable > default" in r.stdout
    r = run_cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert r.returncode == 1
    assert "refusing to bind '0.0.0.0'" in r.stderr and "--insecure" in r.stderr
    # the environment counts too
    r = run_cli("serve", "--port", "0", env={"TENSORWIRE_HOST": "0.0.0.0"})
    assert r.returncode == 1 and "refusing to bind" in r.stderr
