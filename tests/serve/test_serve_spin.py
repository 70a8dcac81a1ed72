"""``TENSORWIRE_SERVE_SPIN_US``: serve's TCP data connections poll their socket that long before they sleep -- the
daemon's session waiting for the next request, the client waiting for a reply (200 us unset; 0: neither polls)."""

from __future__ import annotations

import time

import pytest
import torch

from tensorwire.serve.client.client import Client

from serve_common import in_process

pytestmark = pytest.mark.timeout(120)


def _session_spin(srv, deadline: float = 10.0) -> float:
    """The spin of the daemon's one session's data connection (once it is up)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        sessions = srv.service.sessions()
        if sessions and sessions[0].transport is not None:
            return sessions[0].transport.spin_us
        time.sleep(0.01)
    raise AssertionError("no data connection came up")


@pytest.mark.parametrize("spin, expected", [("", 200.0), ("0", 0.0), ("150", 150.0)])
def test_both_ends_poll_as_long_as_the_setting_says(monkeypatch, spin, expected):
    monkeypatch.setenv("TENSORWIRE_SERVE_SPIN_US", spin)
    tab = torch.randn(300, 16)
    idx = torch.tensor([5, 0, 299, 5])
    with in_process(transport="tcp", max_bytes="64MiB") as srv, Client(srv.address, transport="tcp") as c:
        c.put("t", tab)
        assert torch.equal(c.get_rows("t", idx), tab[idx]) and torch.equal(c.get("t"), tab)
        assert c._path.transport.spin_us == pytest.approx(expected)
        assert _session_spin(srv) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["2000000", "-1", "fast"])
def test_a_bad_value_stops_the_daemon_and_the_client_by_name(monkeypatch, bad):
    from tensorwire.errors import ConfigError

    monkeypatch.setenv("TENSORWIRE_SERVE_SPIN_US", bad)
    with pytest.raises(ConfigError, match="TENSORWIRE_SERVE_SPIN_US"):
        with in_process(transport="tcp"):
            pass
    monkeypatch.delenv("TENSORWIRE_SERVE_SPIN_US")
    with in_process(transport="tcp") as srv:
        monkeypatch.setenv("TENSORWIRE_SERVE_SPIN_US", bad)
        with pytest.raises(ConfigError, match="TENSORWIRE_SERVE_SPIN_US"):
            Client(srv.address, transport="tcp").put("t", torch.zeros(2))
