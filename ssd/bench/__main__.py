"""`python -m ssd.bench`: the bench on its own, and the entry of its worker processes
(`python -m ssd.bench --_worker SPEC`)."""

import sys

from ssd.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
