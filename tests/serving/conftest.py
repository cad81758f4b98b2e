"""The served application for this package's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def served(tiny_pair):
    """The application on a real local Ray Serve (tests/serve_harness.py), started once for the
    tests of this package and stopped after its last one, so that no other test module runs
    beside a Ray cluster in this process (pytest runs this package before the test_*.py files
    beside it: directories sort first)."""
    pytest.importorskip("ray")
    import serve_harness

    s = serve_harness.start(tiny_pair)
    yield s
    serve_harness.stop()
