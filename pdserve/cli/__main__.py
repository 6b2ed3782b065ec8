"""`python -m pdserve.cli`."""

import sys

from pdserve.cli import main

if __name__ == "__main__":  # not in a worker process spawned from this one (guide compiles)
    sys.exit(main())
