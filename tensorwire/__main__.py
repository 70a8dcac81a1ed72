import sys

from tensorwire.cli import main

sys.exit(main())
