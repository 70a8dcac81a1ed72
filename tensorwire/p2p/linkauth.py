"""The link secret: which processes may negotiate and connect links of a job.

Every rank of a job holds the same secret, and nothing of a link is given to a
process that cannot prove it holds it:

- the control plane: each ``Control.Negotiate`` request carries an HMAC of the
  caller's whole declaration under the secret (gRPC metadata
  ``tw-link-mac-bin``), checked in constant time before the server looks at
  anything else; the answer carries an HMAC of the answering declaration bound
  to the request's nonce, checked by the caller. A stranger gets
  ``UNAUTHENTICATED`` (:class:`~tensorwire.AuthError`) and learns no nonce, no
  data port, and takes no declaration away from the real peer;
- the data plane: the dialler's hello carries ``link_proof(secret, nonce)``
  (:mod:`tensorwire.transport.base`), checked by the TCP and UCX listeners
  before the nonce.

Where the secret comes from (:func:`resolve_link_secret`), first match wins:

1. ``Node(link_secret=...)``;
2. ``TENSORWIRE_LINK_TOKEN`` or ``TENSORWIRE_LINK_TOKEN_FILE`` (e.g. a mounted
   Kubernetes Secret; at least 16 characters; set on every rank or on none);
3. the rendezvous store: the first rank to ask writes 32 random bytes under
   ``<prefix>link/secret`` (an atomic ``compare_set``, so it is written once;
   the prefix holds the run id and restart count, so every attempt of an
   elastic job gets a fresh one) and every rank reads it. Whoever can read the
   store can read the secret: the store must be as private as the job.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any, Mapping

from tensorwire.errors import ConfigError, ConnectTimeout
from tensorwire.settings import env_var, setting

__all__ = [
    "SECRET_KEY",
    "SECRET_BYTES",
    "MIN_TOKEN_CHARS",
    "MAC_METADATA",
    "resolve_link_secret",
    "offer_mac",
    "mac_matches",
]

#: Store key (under the node's prefix) of the job's link secret.
SECRET_KEY = "link/secret"
SECRET_BYTES = 32
#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN_CHARS = 16
#: gRPC metadata key of a declaration's MAC (``-bin``: binary value).
MAC_METADATA = "tw-link-mac-bin"

_TOKEN_DOMAIN = b"tensorwire-link-token-v1\0"
_MAC_DOMAIN = b"tensorwire-control-v1\0"


def _from_token(token: bytes, *, source: str) -> bytes:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{source}: a link token needs at least {MIN_TOKEN_CHARS} characters "
            f"(e.g. the output of `openssl rand -hex 32`), got {len(token)}"
        )
    return hashlib.sha256(_TOKEN_DOMAIN + token).digest()


def resolve_link_secret(
    *,
    store: Any,
    key: str,
    explicit: bytes | str | None = None,
    environ: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> bytes:
    """The job's link secret (see the module docstring for the order).

    Args:
        store: the job's rendezvous store (``compare_set``/``get``/``wait``).
        key: the full store key of the secret (``prefix + SECRET_KEY``).
        explicit: a secret given in code (bytes or text, at least 16 of them).
        environ: the environment (default ``os.environ``).
        timeout: how long to wait for the store.

    Raises:
        ConfigError: both token variables set, an unreadable or too short token.
        ConnectTimeout: the store did not answer in time.
    """
    if explicit is not None:
        raw = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
        return _from_token(raw, source="Node(link_secret=...)")
    token, path = setting("link_token", environ), setting("link_token_file", environ)
    if token and path:
        raise ConfigError(f"both {env_var('link_token')} and {env_var('link_token_file')} are set; give one")
    if token:
        return _from_token(token.encode(), source=env_var("link_token"))
    if path:
        try:
            with open(path, "rb") as f:
                raw = f.read(1 << 16)
        except OSError as exc:
            raise ConfigError(f"{env_var('link_token_file')}={path!r} cannot be read: {exc}") from exc
        return _from_token(raw, source=f"{env_var('link_token_file')}={path!r}")
    return _from_store(store, key, timeout)


def _from_store(store: Any, key: str, timeout: float) -> bytes:
    fresh = secrets.token_bytes(SECRET_BYTES)
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            # Written once, by whichever rank comes first; the others read what it wrote.
            got = bytes(store.compare_set(key, b"", fresh))
        except (RuntimeError, TimeoutError, OSError) as exc:  # torch raises DistStoreError (a RuntimeError)
            if time.monotonic() + delay > deadline:
                raise ConnectTimeout(f"cannot read or write the link secret in the rendezvous store: {exc}") from exc
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
            continue
        if len(got) != SECRET_BYTES:
            raise ConfigError(
                f"the rendezvous store holds a malformed link secret under {key!r} "
                f"({len(got)} bytes, expected {SECRET_BYTES})"
            )
        return got


def offer_mac(secret: bytes, offer: Any, *, role: bytes, bound: bytes = b"") -> bytes:
    """HMAC-SHA256 of a whole declaration (a ``LinkOffer``, as deterministic protobuf bytes) under the link secret.

    ``role``: ``b"ask"`` for a request, ``b"answer"`` for the answer; ``bound``:
    the request's nonce for an answer (an answer is good for that request only).
    """
    h = hmac.new(secret, _MAC_DOMAIN + role + b"\0", hashlib.sha256)
    for part in (bound, offer.SerializeToString(deterministic=True)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def mac_matches(secret: bytes, offer: Any, mac: bytes | None, *, role: bytes, bound: bytes = b"") -> bool:
    """Constant-time check of a declaration's MAC."""
    if not mac:
        return False
    return hmac.compare_digest(offer_mac(secret, offer, role=role, bound=bound), bytes(mac))
