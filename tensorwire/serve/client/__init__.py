"""The client of ``tensorwire serve``: :class:`Client` (one daemon; given several, it returns a
:class:`~tensorwire.serve.client.sharded_client.ShardedClient` over all of them)."""

from tensorwire.serve.client.client import Client

__all__ = ["Client"]
