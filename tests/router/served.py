"""A router with its own flow settings over a fresh fake cluster, and an HTTP client into it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from services.router.app import RouterApp
from services.router.config import FlowConfig
from tests.router.conftest import (
    Cluster,
    asgi_client,
    router_config,
    start_cluster,
    start_router,
    stop_router,
    wait_until,
)
from tests.router.fakes import Script


@dataclass
class Served:
    cluster: Cluster
    app: RouterApp
    http: httpx.AsyncClient

    def metric(self, name: str, **labels: str) -> float:
        """The router's ``stageserve_router_<name>`` sample (0 when never set)."""
        registry = self.app.metrics.registry
        return registry.get_sample_value(f"stageserve_router_{name}", labels) or 0.0


@contextlib.asynccontextmanager
async def serve(
    flow: FlowConfig,
    script: Script | None = None,
    num_prefills: int = 1,
    num_decodes: int = 1,
    **overrides,
) -> AsyncIterator[Served]:
    cluster = await start_cluster(script or Script(), num_prefills, num_decodes)
    app = await start_router(router_config(cluster, flow=flow, **overrides))
    # A fake's port may be one an earlier test's worker had: gRPC's shared subchannel to it
    # can still be in reconnect backoff at the router's first poll.
    await wait_until(lambda: all(w.is_ready for w in app.registry.workers()))
    try:
        async with asgi_client(app) as http:
            yield Served(cluster, app, http)
    finally:
        await stop_router(app)
        await cluster.stop()
