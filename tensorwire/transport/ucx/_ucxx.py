"""ucxx, imported once for the package, with the process environment left as it was.

Importing ucxx makes it write a few ``UCX_*`` variables into ``os.environ``;
:func:`_import_ucxx` undoes that and returns them (:data:`ENV_DEFAULTS`), so the
engines hand the same settings to their UCX contexts instead and importing
tensorwire never changes the process environment. Importing this module raises
:class:`ImportError` when ucxx is not installed or cannot load (the caller falls
back to TCP).

Also here: the small functions on ucxx requests and endpoints the other modules share.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = [
    "ENV_DEFAULTS",
    "LOST_ERRORS",
    "Array",
    "Tag",
    "cancelled",
    "close_ep",
    "context_defaults",
    "filled",
    "np",
    "u8",
    "ucx",
]

log = logging.getLogger(__name__)


def _import_ucxx() -> tuple[Any, Any, dict[str, str]]:
    """Import ucxx's core API; undo its os.environ edits and return them as UCX options."""
    already = "ucxx" in sys.modules
    before = None if already else dict(os.environ)
    try:
        import ucxx._lib.libucxx as libucxx
        from ucxx._lib.arr import Array
    except ImportError:
        raise
    except Exception as exc:  # a broken install (libucx missing, ...): same as absent
        raise ImportError(f"ucxx is installed but cannot be loaded: {exc}") from exc
    finally:
        changed: dict[str, str] = {}
        if before is not None:
            after = dict(os.environ)
            for k, v in after.items():
                if before.get(k) != v:
                    changed[k] = v
            for k in after:
                if k not in before:
                    del os.environ[k]
            for k, v in before.items():
                if after.get(k) != v:
                    os.environ[k] = v
    return libucxx, Array, changed


#: ucxx's core API (``ucxx._lib.libucxx``), ucxx's buffer descriptor, and what ucxx wrote into the environment.
ucx, Array, ENV_DEFAULTS = _import_ucxx()
Tag = ucx.UCXXTag
import numpy as np  # noqa: E402 - ucxx depends on numpy; after the ucxx check on purpose

#: ucxx errors that mean the peer (or the way to it) is gone.
LOST_ERRORS = tuple(
    getattr(ucx, n)
    for n in (
        "UCXConnectionResetError",
        "UCXEndpointTimeoutError",
        "UCXUnreachableError",
        "UCXNotConnectedError",
        "UCXRejectedError",
        "UCXIOError",
        "UCXTimedOutError",
        "UCXCloseError",
        "UCXCanceledError",
    )
    if hasattr(ucx, n)
)


def context_defaults() -> dict[str, str]:
    """UCX options (names without ``UCX_``) ucxx would have set through the environment, unless the user set them."""
    opts = ucx.get_current_options()
    return {k[4:]: v for k, v in ENV_DEFAULTS.items() if k.startswith("UCX_") and k[4:] in opts and k not in os.environ}


def u8(n: int) -> Any:
    """A fresh uint8 NumPy buffer of ``n`` bytes (zeroed)."""
    return np.zeros(n, dtype=np.uint8)


def cancelled(req: Any) -> bool:
    """True for no request, or one that ended cancelled (UCX cancels an endpoint's requests on error)."""
    if req is None:
        return True
    if not req.completed:
        return False
    try:
        req.check_error()
    except ucx.UCXCanceledError:
        return True
    except ucx.UCXError:
        return False
    return False


def filled(req: Any) -> bool:
    """Completed and not cancelled (a failed one counts: the caller reports its error)."""
    return req is not None and req.completed and not cancelled(req)


def close_ep(ep: Any) -> None:
    """Cancel the endpoint's requests and close it (force: never waits for the peer)."""
    try:
        ep.close_blocking()
    except Exception as exc:  # noqa: BLE001 - closing is best effort
        log.debug("ucx endpoint close: %s", exc)
