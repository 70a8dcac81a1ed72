"""What the serve client and daemon agree on: constants, the data-request wire format, the shm layout.

Imports neither the client nor the daemon.
"""
