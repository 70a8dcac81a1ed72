"""Helpers for the serve tests: real daemons as subprocesses, in-process servers, a test PKI.

Daemons run as ``python -m tensorwire serve --port 0 ...`` and report their
bound ports on their first stdout line (JSON); every one is killed in a
``finally``. Collected by pytest as a module, it holds one self-check test.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import pytest
import torch

#: The dtypes the serve tests put through every path (one of each kind: float, int, unsigned, bool).
ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]

ROOT = pathlib.Path(__file__).resolve().parents[2]


def ucx_usable() -> bool:
    """Whether tensorwire's UCX transport can be created here (ucxx importable and working)."""
    try:
        from tensorwire.transport.base import get_factory

        get_factory("ucx")
        return True
    except Exception:  # noqa: BLE001
        return False


def shm_room(need: int = 256 << 20) -> bool:
    """Whether /dev/shm exists with ``need`` bytes free (a container's default 64 MiB one does not)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= need


# the "shm" parameter of serve tests: skipped where the daemon could not put its slots in /dev/shm
# (it would serve them over the socket instead, correctly, and the test's shm assertions would fail)
SHM = pytest.param("shm", marks=pytest.mark.skipif(not shm_room(), reason="no /dev/shm, or under 256 MiB free"))


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test's environment without TENSORWIRE_* (a developer's settings must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


class Daemon:
    """``tensorwire serve`` in a subprocess; ``info`` is its ready line."""

    def __init__(
        self,
        *args: str,
        transport: str = "tcp",
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        port: int = 0,
        preexec_fn: Any = None,
    ) -> None:
        self.cmd = [sys.executable, "-m", "tensorwire", "serve", "--port", str(port), "--transport", transport, *args]
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=clean_env(env),
            text=True,
            preexec_fn=preexec_fn,
        )
        try:
            line = self._first_line(timeout)
            self.info: dict[str, Any] = json.loads(line)
        except BaseException:
            self.kill()
            raise
        self.port = int(self.info["port"])
        self.address = f"127.0.0.1:{self.port}"

    def _first_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                line = self.proc.stdout.readline()
                if line:
                    return line
            if self.proc.poll() is not None:
                break
        raise AssertionError(f"daemon did not become ready (rc={self.proc.poll()}):\n{self.log()}")

    def log(self) -> str:
        self._err.seek(0)
        return self._err.read().decode("utf-8", "replace")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def close(self) -> None:
        # SIGTERM first: a daemon that exits normally unlinks its shared-memory regions (a SIGKILLed
        # one leaves them for the next daemon to clean up, see tensorwire/serve/daemon/shm.py).
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        self._err.close()

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def in_process(**config: Any) -> Iterator[Any]:
    """An in-process Server bound to port 0 (TCP data plane unless told otherwise)."""
    from tensorwire.serve import ServeConfig, Server

    config.setdefault("port", 0)
    config.setdefault("transport", "tcp")
    config.setdefault("max_bytes", "1GiB")
    srv = Server(ServeConfig(**config)).start()
    try:
        yield srv
    finally:
        srv.stop(timeout=5)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorwire", *args],
        cwd=ROOT,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def make_pki(directory: pathlib.Path) -> dict[str, str]:
    """Two CAs, a server cert (localhost/127.0.0.1) and a client cert, both signed by CA 1.

    Uses the ``cryptography`` package, else the ``openssl`` CLI; skips the test if neither exists.
    """
    try:
        _pki_cryptography(directory)
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl CLI is available")
        _pki_openssl(directory)
    return {
        n: str(directory / n) for n in ("ca1.pem", "ca2.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


def _pki_cryptography(d: pathlib.Path) -> None:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def pem_key(k: Any) -> bytes:
        return k.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def builder(subject: Any, issuer: Any, pub: Any) -> Any:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(pub)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
        )

    cas = {}
    for name in ("ca1", "ca2"):
        k = ec.generate_private_key(ec.SECP256R1())
        subj = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tensorwire test {name}")])
        c = (
            builder(subj, subj, k.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(k, hashes.SHA256())
        )
        (d / f"{name}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        cas[name] = (k, c)
    cak, cac = cas["ca1"]
    for name, san in (("server", True), ("client", False)):
        k = ec.generate_private_key(ec.SECP256R1())
        b = builder(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost" if san else "client")]),
            cac.subject,
            k.public_key(),
        )
        if san:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        c = b.sign(cak, hashes.SHA256())
        (d / f"{name}.pem").write_bytes(c.public_bytes(serialization.Encoding.PEM))
        (d / f"{name}.key").write_bytes(pem_key(k))


def _pki_openssl(d: pathlib.Path) -> None:  # pragma: no cover - used where cryptography is missing
    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    for name in ("ca1", "ca2"):
        run(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=tensorwire test {name}",
        )
    (d / "san.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn in (("server", "localhost"), ("client", "client")):
        run(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={cn}",
        )
        extra = ["-extfile", "san.cnf"] if name == "server" else []
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca1.pem",
            "-CAkey",
            "ca1.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            *extra,
        )


@pytest.mark.timeout(60)
def test_daemon_helper_reports_bound_ports_and_exits_cleanly_on_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    with Daemon(env={"TENSORWIRE_READY_FILE": str(ready), "TENSORWIRE_METRICS_PORT": "0"}) as d:
        assert d.info["event"] == "ready" and d.port > 0
        assert d.info["transport"] == "tcp" and d.info["data"][0]["port"] > 0
        assert json.loads(ready.read_text()) == d.info  # the same line, written atomically
        assert d.info["metrics_port"] > 0
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0, d.log()
        assert "listening on" in d.log()
