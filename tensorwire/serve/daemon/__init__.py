"""The ``tensorwire serve`` daemon: config -> server -> service, its store, sessions and snapshots."""
