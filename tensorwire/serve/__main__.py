"""``python -m tensorwire.serve``: the daemon alone (same flags as ``tensorwire serve``)."""

import sys

from tensorwire.serve.cli import main

sys.exit(main())
