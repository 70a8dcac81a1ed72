"""Point-to-point links between the ranks of a job.

``node`` (one per process: control server, data listeners, bootstrap store) makes
``Link`` objects to peers; ``control`` is the gRPC negotiation of specs and transport
addresses; ``bootstrap`` and ``torchrun`` read the torchrun environment contract.
"""
