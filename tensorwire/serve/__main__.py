"""``python -m tensorwire.serve``: the daemon alone (same flags as ``tensorwire serve``)."""

import sys

from .cli import main

sys.exit(main())
