"""`python -m ssd.worker`: one draft worker process (ssd/worker/main.py)."""

import logging
import os
import sys

from ssd.worker.main import main

code = main()
# Exit without finalizing the interpreter: tearing down one that imported torch and transformers
# takes ~0.9 s on the project's CPU, and the target's close() waits for this process to exit.
# Nothing here needs finalizing beyond the logs and stdio.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
