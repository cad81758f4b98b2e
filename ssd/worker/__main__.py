"""`python -m ssd.worker`: one draft worker process (ssd/worker/main.py)."""

import sys

from ssd.worker.main import main

sys.exit(main())
