"""Helpers for the torchrun tests: bounded process groups, free ports, network namespaces.

Every process is started in its own session (``start_new_session=True``), so
the test can kill the whole tree — torchrun, its agent, the workers — with one
``os.killpg``, and does so in ``finally`` whatever happened. Output goes to a
file (never a pipe that could fill up and block the child).

:class:`NetnsPair` builds two network namespaces joined by a veth pair
(10.203.0.1/24 and 10.203.0.2/24 by default, lo up in each) and always
deletes them again. Traffic stays inside these namespaces and loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pipeline_parallel.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Variables a torchrun worker inherits that must not leak from the test's own environment.
_SCRUB = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TENSORWIRE_HOST",
    "TENSORWIRE_TRANSPORT",
    "TENSORWIRE_TIMEOUT",
    "TENSORWIRE_PEER_TIMEOUT",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment, tensorwire importable from the checkout, torchrun variables scrubbed."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("UCX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("PYTHONUNBUFFERED", None)  # unbuffered print() writes text and newline separately: lines interleave
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TENSORWIRE_LOG_LEVEL", "WARNING")
    env.update(extra)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it back, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own session, output in ``log``; ``kill()`` ends its whole group."""

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str], log: Path, cwd: Path = REPO) -> None:
        self.cmd = list(cmd)
        self.log = log
        log.write_bytes(b"")
        self._fh = open(log, "ab")  # O_APPEND: whole lines from concurrent writers stay whole
        self.popen = subprocess.Popen(
            self.cmd,
            env=env,
            cwd=cwd,
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pgid = self.popen.pid  # session leader: its pid is the group id

    def output(self) -> str:
        self._fh.flush()
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the whole tree (idempotent), then reap the leader.

        torchrun starts every worker in a session of its own, so killing our
        group alone would orphan the workers: every descendant's group is
        killed as well (collected before anything dies and gets re-parented).
        """
        pids = [self.popen.pid, *descendants(self.popen.pid)]
        groups = {self.pgid}
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        groups.discard(os.getpgid(0))  # never our own group
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._fh.close()

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False


def descendants(root: int) -> list[int]:
    """Every live descendant of ``root`` (children first), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def run(cmd: Sequence[str], *, env: dict[str, str], log: Path, timeout: float) -> tuple[int, str]:
    """Run to completion within ``timeout`` (else kill the group and fail); returns (exit code, output)."""
    p = Proc(cmd, env=env, log=log)
    try:
        rc = p.wait(timeout)
        if rc is None:
            raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout}s; output:\n{tail(p.output())}")
        return rc, p.output()
    finally:
        p.kill()


def tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


def torchrun_standalone(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    return [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        str(EXAMPLE),
        *args,
    ]


# ---------------------------------------------------------------------------
# network namespaces
# ---------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def netns_unavailable() -> str | None:
    """Why the namespace tests cannot run here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    name = f"twprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            return f"ip netns add failed: {r.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns add failed: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
    return None


class NetnsPair:
    """Two namespaces joined by a veth pair; ``with NetnsPair() as net: net.exec(0, cmd)``.

    Attributes:
        ns: the two namespace names; addr: their addresses; dev: the veth name in each.
    """

    def __init__(self, subnet: str = "10.203.0", tag: str | None = None) -> None:
        tag = tag or f"{os.getpid() % 100000}"
        self.ns = (f"tw-a-{tag}", f"tw-b-{tag}")
        self.dev = (f"twa{tag}"[:15], f"twb{tag}"[:15])
        self.addr = (f"{subnet}.1", f"{subnet}.2")

    def __enter__(self) -> "NetnsPair":
        self.delete()  # leftovers of an earlier crashed run with the same tag
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip(
                "link",
                "add",
                self.dev[0],
                "netns",
                self.ns[0],
                "type",
                "veth",
                "peer",
                "name",
                self.dev[1],
                "netns",
                self.ns[1],
            )
            for i, ns in enumerate(self.ns):
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i])
                _ip("-n", ns, "link", "set", self.dev[i], "up")
            self._wait_reachable()
        except BaseException:
            self.delete()
            raise
        return self

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait for both ends of the veth to be up (carrier), and for a ping to pass when ping exists."""
        deadline = time.monotonic() + timeout
        while True:
            states = [_ip("-n", ns, "link", "show", dev).stdout for ns, dev in zip(self.ns, self.dev)]
            if all("LOWER_UP" in s for s in states):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"veth did not come up: {states}")
            time.sleep(0.05)
        if shutil.which("ping") is None:
            return
        while time.monotonic() < deadline:
            r = subprocess.run(
                ["ip", "netns", "exec", self.ns[0], "ping", "-c", "1", "-W", "1", self.addr[1]],
                capture_output=True,
                timeout=10,
            )
            if r.returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.addr[1]} not reachable from {self.ns[0]}")

    def prefix(self, i: int) -> list[str]:
        """Command prefix that runs in namespace ``i``."""
        return ["ip", "netns", "exec", self.ns[i]]

    def cut(self, i: int) -> None:
        """Take namespace ``i``'s end of the veth down (the link is cut both ways)."""
        _ip("-n", self.ns[i], "link", "set", self.dev[i], "down")

    def restore(self, i: int) -> None:
        """Bring namespace ``i``'s end of the veth back up (the partition heals)."""
        _ip("-n", self.ns[i], "link", "set", self.dev[i], "up")

    def delete(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def __exit__(self, *exc: object) -> None:
        self.delete()


class NetnsStar:
    """A client namespace and ``n`` daemon namespaces, each joined to a bridge in the client's by a veth.

    ``with NetnsStar(3) as net``: the client is at ``net.client_addr``, daemon ``i`` at ``net.addr[i]``;
    ``net.prefix(i)`` runs in daemon ``i``'s namespace, ``net.client_prefix()`` in the client's;
    ``cut(i)`` / ``restore(i)`` take daemon ``i``'s link down and up. Always deleted again.
    """

    def __init__(self, n: int = 3, subnet: str = "10.204.0", tag: str | None = None) -> None:
        tag = tag or f"{os.getpid() % 100000}"
        self.client_ns = f"tw-sc-{tag}"
        self.ns = tuple(f"tw-s{i}-{tag}" for i in range(n))
        self.bridge = f"twbr{tag}"[:15]
        self.dev = tuple(f"tws{i}{tag}"[:15] for i in range(n))  # in daemon i's namespace
        self.peer = tuple(f"twp{i}{tag}"[:15] for i in range(n))  # its other end, on the bridge
        self.client_addr = f"{subnet}.1"
        self.addr = tuple(f"{subnet}.{11 + i}" for i in range(n))

    def __enter__(self) -> "NetnsStar":
        self.delete()
        try:
            for ns in (self.client_ns, *self.ns):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            c = self.client_ns
            _ip("-n", c, "link", "add", self.bridge, "type", "bridge")
            _ip("-n", c, "addr", "add", f"{self.client_addr}/24", "dev", self.bridge)
            _ip("-n", c, "link", "set", self.bridge, "up")
            for i, ns in enumerate(self.ns):
                _ip("link", "add", self.dev[i], "netns", ns, "type", "veth", "peer", "name", self.peer[i], "netns", c)
                _ip("-n", c, "link", "set", self.peer[i], "master", self.bridge)
                _ip("-n", c, "link", "set", self.peer[i], "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.dev[i])
                _ip("-n", ns, "link", "set", self.dev[i], "up")
            self._wait_reachable()
        except BaseException:
            self.delete()
            raise
        return self

    def _wait_reachable(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        for a in self.addr:
            while True:
                if shutil.which("ping") is None:
                    break
                r = subprocess.run(
                    [*self.client_prefix(), "ping", "-c", "1", "-W", "1", a], capture_output=True, timeout=10
                )
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{a} not reachable from {self.client_ns}")
                time.sleep(0.1)

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[i]]

    def client_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.client_ns]

    def cut(self, i: int) -> None:
        _ip("-n", self.ns[i], "link", "set", self.dev[i], "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.ns[i], "link", "set", self.dev[i], "up")

    def delete(self) -> None:
        for ns in (*self.ns, self.client_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)

    def __exit__(self, *exc: object) -> None:
        self.delete()
