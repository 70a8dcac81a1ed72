"""The floor of a Python ``torch.distributed`` backend: a ProcessGroup that only moves bytes over one TCP socket.

``bench/bench_distributed.py`` times it beside gloo and tensorwire at the small sizes, in the same turns. Its
``send`` is one ``sendall`` of the tensor's bytes; its ``recv`` polls ``recv_into`` (``MSG_DONTWAIT``) straight into
the tensor until every byte came; both return a Work that is already complete. It checks nothing: no shape
or dtype agreement, no tags, no ordering between callers, no timeout, no lost-peer detection, no eager buffers or
flow control, two ranks only. What it costs per round trip is what torch's dispatch into a Python ProcessGroup
and the socket calls cost on the machine: the round trip no Python backend can go below.

Not a backend to use: it exists to be measured.
"""

from __future__ import annotations

import socket
from typing import Any

NAME = "python-floor"


def register() -> None:
    """Make ``dist.new_group(backend="python-floor")`` build a :func:`floor group <_make>` (two ranks)."""
    import torch.distributed as dist

    if hasattr(dist.Backend, NAME.upper()):  # registered already
        return
    dist.Backend.register_backend(NAME, _make, devices=["cpu"])


def _make(store: Any, rank: int, size: int, timeout: Any) -> Any:
    import torch.distributed as dist

    if size != 2:
        raise ValueError(f"the {NAME} group has exactly two ranks, not {size}")

    class _Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class FloorGroup(dist.ProcessGroup):
        def __init__(self) -> None:
            super().__init__(rank, size)
            if rank == 0:
                lsock = socket.socket()
                lsock.bind(("127.0.0.1", 0))
                lsock.listen(1)
                store.set(f"{NAME}/port", str(lsock.getsockname()[1]))
                self.sock, _ = lsock.accept()
                lsock.close()
            else:
                self.sock = socket.create_connection(("127.0.0.1", int(store.get(f"{NAME}/port"))))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def send(self, tensors: list[Any], dst: int, tag: int = 0) -> Any:
            self.raw_send(memoryview(tensors[0].numpy()).cast("B"))
            return _Done()

        def recv(self, tensors: list[Any], src: int, tag: int = 0) -> Any:
            self.raw_recv(memoryview(tensors[0].numpy()).cast("B"))
            return _Done()

        # The socket calls alone (bench_distributed.py also times them without torch in between).
        def raw_send(self, view: memoryview) -> None:
            self.sock.sendall(view)

        def raw_recv(self, view: memoryview) -> None:
            n, got = len(view), 0
            while got < n:
                try:
                    k = self.sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if k == 0:
                    raise ConnectionError("the other rank closed the floor group's socket")
                got += k

        def getBackendName(self) -> str:
            return NAME

        # torch names the group through these (destroy_process_group looks it up by that name)
        def setGroupName(self, name: str) -> None:
            self._group_name = name

        def getGroupName(self) -> str:
            return getattr(self, "_group_name", "")

        def setGroupDesc(self, desc: str) -> None:
            self._group_desc = desc

        def getGroupDesc(self) -> str:
            return getattr(self, "_group_desc", "")

        def shutdown(self) -> None:
            self.sock.close()

    return FloorGroup()
