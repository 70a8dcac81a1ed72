"""``--max-bytes`` bounds the daemon: every buffer a session makes it allocate is charged, and freed at its end.

Measured on a real daemon subprocess: its RSS (/proc/<pid>/status VmRSS) and
its own accounting (``tensorwire_reserved_bytes`` on the metrics endpoint).
"""

from __future__ import annotations

import time

import pytest
import torch

import tensorwire as tw
from flood import metric, rss_bytes
from serve_common import Daemon

pytestmark = [pytest.mark.attack, pytest.mark.timeout(120)]

MiB = 1 << 20
ROWS, COLS = 4096, 1024  # float32: a 16 MiB table; all of its rows at once need a 16 MiB row buffer


def _wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


@pytest.mark.parametrize("data_requests", [True, False], ids=["data-requests", "grpc-calls"])
def test_row_buffers_of_many_sessions_are_charged_to_max_bytes_and_freed_when_they_close(data_requests):
    max_bytes = 96 * MiB
    with Daemon("--no-shm", "--max-bytes", str(max_bytes), "--metrics-port", "0", transport="tcp") as d:
        mport = d.info["metrics_port"]
        table = torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)
        every = torch.arange(ROWS)
        with tw.Client(d.address, transport="tcp") as owner:
            owner.put("table", table)  # reserves 32 MiB (double buffer)
        # the session counts as closed at once; its worker frees its buffers a moment later
        assert _wait_for(lambda: metric(mport, "tensorwire_sessions") == 0)
        assert _wait_for(lambda: metric(mport, "tensorwire_session_buffer_bytes") == 0)
        base_reserved = metric(mport, "tensorwire_reserved_bytes")
        base_rss = rss_bytes(d.proc.pid)
        clients, refused = [], []
        try:
            for i in range(8):  # 8 x 16 MiB of row buffers would be 128 MiB: more than is left
                c = tw.Client(d.address, transport="tcp", data_requests=data_requests, name=f"rows-{i}")
                clients.append(c)
                try:
                    got = c.get_rows("table", every)
                    assert torch.equal(got, table)
                    c.put_rows("table", every[:8], table[:8])  # through the same buffer
                except tw.ResourceExhaustedError as exc:
                    assert "max-bytes" in str(exc)
                    refused.append(i)
                reserved = metric(mport, "tensorwire_reserved_bytes")
                assert reserved <= max_bytes, f"{reserved / MiB:.0f} MiB charged, over --max-bytes"
            grown = rss_bytes(d.proc.pid) - base_rss
            assert refused, "every session got its 16 MiB row buffer: nothing bounds them"
            assert len(refused) < 8, "no session could read rows at all"
            assert grown <= (max_bytes - base_reserved) + 24 * MiB, (
                f"RSS grew by {grown / MiB:.0f} MiB with {max_bytes / MiB:.0f} MiB --max-bytes "
                f"({base_reserved / MiB:.0f} MiB reserved before)"
            )
            assert metric(mport, "tensorwire_session_buffer_bytes") > 0
            # while the buffers hold what is left, a new tensor is refused cleanly, not allocated
            with pytest.raises(tw.ResourceExhaustedError, match="max-bytes"):
                clients[0].put("more", torch.zeros(8 * MiB // 4))
        finally:
            for c in clients:
                c.close()
        # closed sessions give everything back at once (not at the next garbage collection)
        assert _wait_for(lambda: metric(mport, "tensorwire_reserved_bytes") == base_reserved), (
            metric(mport, "tensorwire_reserved_bytes"),
            base_reserved,
        )
        assert metric(mport, "tensorwire_session_buffer_bytes") == 0
        assert _wait_for(lambda: rss_bytes(d.proc.pid) - base_rss <= 24 * MiB), (
            f"RSS stayed {(rss_bytes(d.proc.pid) - base_rss) / MiB:.0f} MiB above its level before the sessions"
        )
        with tw.Client(d.address, transport="tcp") as c:  # and the memory is usable again
            assert torch.equal(c.get_rows("table", every[:16]), table[:16])
        assert d.proc.poll() is None, d.log()
