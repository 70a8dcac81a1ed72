"""Sandbox for UCX worker addresses sent by untrusted peers (``python -m tensorwire.transport.ucx.addrcheck TLS FD``).

UCX unpacks a worker address with assertions, not errors: random bytes sent as
one abort the process that unpacks them (``address.c: Assertion
`*addr_version == UCP_OBJECT_VERSION_V2' failed``). A serve daemon must never
be that process, so :class:`tensorwire.transport.ucx.UcxListener` with
``untrusted=True`` first hands each address to this small process, which
makes (and at once closes) an endpoint from it with the daemon's own UCX
transport list and answers ``Y``, or dies; the daemon then refuses the peer
and starts a fresh sandbox for the next one (``AddressCheck`` in
:mod:`tensorwire.transport.ucx.listener`).

Protocol: 4-byte little-endian length + address in on stdin; one byte out on
file descriptor ``FD`` (a pipe of its own: whatever UCX prints cannot be taken
for an answer): ``R`` once ready, then ``Y`` or ``N`` per address.
"""

from __future__ import annotations

import os
import struct
import sys
import time

from tensorwire.transport.ucx._ucxx import context_defaults, ucx


def _read(n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def main(argv: list[str]) -> int:
    tls = argv[1] if len(argv) > 1 else ""
    out = int(argv[2]) if len(argv) > 2 else 1
    config = context_defaults()
    if tls:
        config["TLS"] = tls
    ctx = ucx.UCXContext(config_dict=config, feature_flags=(ucx.Feature.TAG,))
    worker = ucx.UCXWorker(ctx)
    os.write(out, b"R")  # ready
    while True:
        try:
            (n,) = struct.unpack("<I", _read(4))
            addr = _read(n)
        except EOFError:
            return 0
        try:
            ep = ucx.UCXEndpoint.create_from_worker_address(worker, ucx.UCXAddress.create_from_buffer(addr), True)
        except Exception:  # noqa: BLE001 - an error (not an abort) is a refusal too
            os.write(out, b"N")
            continue
        try:
            ep.close()
            end = time.monotonic() + 0.05
            while time.monotonic() < end and worker.progress_once():
                pass
        except Exception:  # noqa: BLE001 - the address unpacked; closing is best effort
            pass
        os.write(out, b"Y")


if __name__ == "__main__":  # pragma: no cover - run as a subprocess
    sys.exit(main(sys.argv))
