"""UCX data plane (ucxx core API): tagged messages straight into the posted slots.

Importing this package raises :class:`ImportError` when ucxx is not installed
(the caller falls back to TCP); it leaves ``os.environ`` as it was (ucxx's own
edits are undone and handed to the UCX context instead), and no UCX context or
worker exists until the first listener or connection is made.

How it works -- tags, credits, headers, the progress model, connection set-up,
peer death and error handling, untrusted peers, liveness, buffers -- with the
measurements behind each choice: ``docs/transports.md``, "The UCX transport".

Modules: :mod:`._ucxx` (the ucxx import), :mod:`.wire` (tag layout, messages,
handshake format), :mod:`.engine` (the process-wide engines and their progress),
:mod:`.connection` (an endpoint's life: liveness, goodbye, errors, teardown),
:mod:`.endpoint` (:class:`UcxTransport`: receives, credits, sends), :mod:`.tagstate`
(what one tag needs on the hot path, made once), :mod:`.listener` (:class:`UcxListener` and the handshake), :mod:`.addrcheck`
(the sandbox that unpacks untrusted worker addresses).
"""

from tensorwire.transport.ucx.endpoint import UcxTransport
from tensorwire.transport.ucx.listener import UcxListener
from tensorwire.transport.ucx.wire import HELLO, HELLO_MAGIC, PROTOCOL_VERSION, REPLY, REPLY_NO, REPLY_OK

__all__ = ["UcxTransport", "UcxListener", "HELLO", "HELLO_MAGIC", "PROTOCOL_VERSION", "REPLY", "REPLY_NO", "REPLY_OK"]
