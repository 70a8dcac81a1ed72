"""The client of ``tensorwire serve``: :class:`Client` (one daemon)."""

from tensorwire.serve.client.client import Client

__all__ = ["Client"]
