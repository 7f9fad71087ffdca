"""``python -m shoal ...`` is the ``shoal`` command (workers are started this way)."""

import sys

from shoal.ops.cli import main

if __name__ == "__main__":
    sys.exit(main())
