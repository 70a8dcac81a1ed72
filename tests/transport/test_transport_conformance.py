"""Every transport passes the same conformance checks (tensorwire.testing)."""

from __future__ import annotations


import pytest

from tcp_pairs import tcp_pair

from tensorwire.testing import CHECKS
from tensorwire.transport.memory import memory_pair
from tensorwire.transport.tcp import TcpListener


@pytest.fixture(scope="module")
def tcp_listener():
    lst = TcpListener("127.0.0.1", port=0)
    yield lst
    lst.close()


def _tcp_maker(listener: TcpListener):
    def make():
        return tcp_pair(listener)

    return make


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_memory_transport_conforms(check):
    CHECKS[check](memory_pair)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_tcp_transport_conforms(check, tcp_listener):
    CHECKS[check](_tcp_maker(tcp_listener))
