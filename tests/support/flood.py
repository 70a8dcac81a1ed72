"""Helpers for the attack tests and bench/bench_attack.py: connection floods, RSS and metrics of a daemon.

Everything here talks to 127.0.0.1 only.
"""

from __future__ import annotations

import re
import resource
import socket
import threading
import time
import urllib.request


def raise_nofile(want: int = 8192) -> int:
    """Raise this process's soft RLIMIT_NOFILE towards ``want`` (bounded by the hard limit); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


class Flood:
    """``n`` idle TCP connections to ``127.0.0.1:port`` that never send a byte (or send ``payload`` once).

    A background thread reconnects all of them every ``refresh`` seconds (those
    the server dropped meanwhile included), as an attacker keeping the pressure
    on would. ``opened`` counts every connection made.
    """

    def __init__(self, port: int, n: int, *, refresh: float = 2.0, payload: bytes = b"") -> None:
        self.port = port
        self.n = n
        self.refresh = refresh
        self.payload = payload
        self.opened = 0
        self.failed = 0
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> "Flood":
        self._fill()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self._socks:
            s.close()
        self._socks.clear()

    def _one(self) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect_ex(("127.0.0.1", self.port))
            if self.payload:
                try:
                    s.send(self.payload)
                except OSError:
                    pass
        except OSError:
            s.close()
            self.failed += 1
            return None
        self.opened += 1
        return s

    def _fill(self) -> None:
        while len(self._socks) < self.n and not self._stop.is_set():
            s = self._one()
            if s is None:
                time.sleep(0.01)
                continue
            self._socks.append(s)

    def _run(self) -> None:
        # every ``refresh`` seconds: all of them anew (those the server dropped meanwhile included)
        while not self._stop.wait(self.refresh):
            old, self._socks = self._socks, []
            for s in old:
                s.close()
            self._fill()


def rss_bytes(pid: int) -> int:
    """VmRSS of process ``pid`` (from /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(port: int, name: str) -> float:
    """One unlabelled sample of a daemon's Prometheus endpoint on 127.0.0.1."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body, re.M)
    if m is None:
        raise KeyError(name)
    return float(m.group(1))
