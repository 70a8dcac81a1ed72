"""The copy-engine path: CUDA tensors between processes of one host, one-sided and stream-ordered.

- :mod:`.driver`: the CUDA driver calls (IPC export/open in the local context, host registration, copies,
  flag writes and waits on streams);
- :mod:`.region`: the shared host memory of one pair (a process-shared lock, channels, entries, flag words);
- :mod:`.pair`: the protocol -- each message meets in an entry; the side that arrives second queues the copy;
- :mod:`.graphs`: messages captured in CUDA graphs (their own entries, flags the graph resets);
- :mod:`.exports`: this process's CUDA IPC exports and imports;
- :mod:`.setup`: whether this process can take the path, the region's exchange over a store, the watchdog;
- :mod:`.probe`: the set-up probe -- one real message each way through a new pair before it is used.

See ``docs/distributed.md`` ("The copy-engine path").
"""

from .driver import CeDriver, DriverError, NotExportable
from .exports import Exports
from .graphs import CaptureError
from .pair import CeOp, CePair
from .probe import probe_pair
from .region import Region
from .setup import Watchdog, capable, exchange_region

__all__ = [
    "CaptureError",
    "CeDriver",
    "CeOp",
    "CePair",
    "DriverError",
    "Exports",
    "NotExportable",
    "Region",
    "Watchdog",
    "capable",
    "exchange_region",
    "probe_pair",
]
