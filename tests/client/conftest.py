"""The client against a real router in this event loop, wired to the router tests' fake
workers (``tests/router/conftest.py``)."""

from tests.router.conftest import cluster, router, script  # noqa: F401
