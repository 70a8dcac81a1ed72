"""A polling wait stands down while its thread waits for CPUs (tensorwire.transport.contention): the look at the
thread's run delay, its cache between looks, the setting that turns it off, and a TCP reader that sleeps at once
when the look says the CPUs are taken."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tensorwire.settings import setting
from tensorwire.transport import contention

from tcp_pairs import tcp_pair_on_port_0

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def delays(monkeypatch):
    """The run delay ``contended`` reads, set by the test (seconds), and a fresh per-thread state."""
    now = [5.0]
    monkeypatch.setattr(contention, "_run_delay_s", lambda: now[0])
    monkeypatch.setattr(contention, "_usable", [True])
    monkeypatch.setattr(contention, "_state", threading.local())
    return now


def test_waiting_for_cpus_over_a_tenth_of_the_time_is_contention(delays):
    e = 1.5 * contention.CHECK_EVERY  # (a step past the interval between two looks)
    assert contention.contended(100.0) is False  # the first look only takes the baseline
    delays[0] += 0.5 * e  # half the time since runnable, not running
    assert contention.contended(100.0 + e) is True
    delays[0] += 0.02 * e  # then 2 %: free again
    assert contention.contended(100.0 + 2 * e) is False


def test_between_two_looks_the_last_answer_holds(delays):
    e = 1.5 * contention.CHECK_EVERY
    contention.contended(10.0)
    delays[0] += e
    assert contention.contended(10.0 + e) is True
    delays[0] = 0.0  # not read again before CHECK_EVERY has passed
    assert contention.contended(10.0 + e + 0.5 * contention.CHECK_EVERY) is True


def test_each_thread_looks_at_its_own_delay(delays):
    e = 1.5 * contention.CHECK_EVERY
    contention.contended(1.0)
    delays[0] += e
    assert contention.contended(1.0 + e) is True
    seen = []
    th = threading.Thread(target=lambda: seen.append(contention.contended(1.0 + e)))
    th.start()
    th.join(10)
    assert seen == [False]  # another thread's first look: a baseline of its own


def test_an_unreadable_file_means_never_contended(monkeypatch):
    monkeypatch.setattr(contention, "_PATH", "/nonexistent/schedstat")
    monkeypatch.setattr(contention, "_usable", [True])
    monkeypatch.setattr(contention, "_state", threading.local())
    assert contention._run_delay_s() == -1.0
    assert contention.contended(3.0) is False
    assert contention._usable == [False]  # not tried again


def test_the_real_file_is_read_where_linux_has_it():
    if not contention.os.path.exists(contention._PATH):
        pytest.skip("no /proc/thread-self/schedstat here")
    a = contention._run_delay_s()
    assert a >= 0.0
    assert contention._run_delay_s() >= a  # cumulative


def test_the_setting_turns_it_off(monkeypatch):
    assert setting("spin_contended", {}) is False
    assert setting("spin_contended", {"TENSORWIRE_SPIN_CONTENDED": "1"}) is True
    monkeypatch.setenv("TENSORWIRE_SPIN_CONTENDED", "1")
    assert contention._wanted() is False
    monkeypatch.setenv("TENSORWIRE_SPIN_CONTENDED", "0")
    assert contention._wanted() is True


def test_a_bad_value_is_logged_by_name_and_the_default_kept(monkeypatch, caplog):
    monkeypatch.setenv("TENSORWIRE_SPIN_CONTENDED", "sometimes")
    with caplog.at_level("WARNING", logger="tensorwire.transport.contention"):
        assert contention._wanted() is True
    assert "TENSORWIRE_SPIN_CONTENDED" in caplog.text and "as by default" in caplog.text


@pytest.mark.pure_python
@pytest.mark.parametrize("busy", [False, True])
def test_a_reader_on_contended_cpus_sleeps_instead_of_polling(monkeypatch, busy):
    from tensorwire.transport.tcp import reader

    looks: list[float] = []

    def fake(now=None):
        looks.append(now)
        return busy

    monkeypatch.setattr(reader, "contended", fake)
    with tcp_pair_on_port_0() as (a, b):
        b.set_spin(900_000)  # polls up to 0.9 s before it sleeps
        got = torch.zeros(16, dtype=torch.uint8)
        b.post_recv(1, got)
        timer = threading.Timer(0.2, lambda: a.send(1, torch.full((16,), 3, dtype=torch.uint8), timeout=10))
        timer.start()
        c0 = time.thread_time()
        assert b.wait_recv(1, timeout=10).nbytes == 16
        cpu = time.thread_time() - c0
        timer.join(10)
    assert looks and bool((got == 3).all())
    if busy:
        assert cpu < 0.05, cpu  # slept in the kernel for the 0.2 s
    else:
        assert cpu > 0.05, cpu  # polled (the control: the same wait does burn CPU when not told otherwise)
