"""Wires a router from its config: clients, registry, pipeline, HTTP and gRPC servers."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI

from services.common.auth import Credentials
from services.common.clients.decode import DecodeClient
from services.common.clients.prefill import PrefillClient
from services.common.clients.tokenizer import TokenizerClient
from services.common.clients.vision_encoder import VisionEncoderClient
from services.common.pb.stageserve.v1 import router_pb2_grpc
from services.common.server import HealthState, create_server
from services.engine.processing import ImageProcessor, TextProcessor
from services.router.auth import RouterAccess, require_api_key
from services.router.config import STOP_AFTER_DRAIN_S, RouterConfig
from services.router.discovery import BaseResolver, SystemResolver, WorkerDiscovery
from services.router.generation import GenerationPipeline
from services.router.grammars import GrammarChecker
from services.router.health_generate import HealthGenerateChecker
from services.router.health_probe import HealthProbe
from services.router.http_api import ApiLimits, OpenAIApi, create_app
from services.router.http_server import (
    ACCEPT_BATCH,
    LISTEN_BACKLOG,
    connection_budget,
    protocol_class,
)
from services.router.images import ImageLoader
from services.router.metrics import RouterMetrics
from services.router.policy import make_policy
from services.router.registry import WorkerRegistry
from services.router.servicer import RouterServicer, ServicerLimits
from services.router.tools import resolve_tool_format
from services.router.workers import Worker, WorkerKind, parse_dns_name

SERVICE_NAME = "stageserve.v1.Router"
# After the drain (``RouterApp.drain``, up to ``cfg.drain_s``), within STOP_AFTER_DRAIN_S.
GRPC_GRACE_S = 3.0
HTTP_GRACE_S = 3.0
ABORTS_S = 2.0  # decode's Aborts of the requests the drain budget cut off
assert GRPC_GRACE_S + HTTP_GRACE_S + ABORTS_S < STOP_AFTER_DRAIN_S
CLIENTS: dict[WorkerKind, Callable[..., Any]] = {  # (address, *, auth) -> client
    WorkerKind.TOKENIZER: TokenizerClient,
    WorkerKind.PREFILL: PrefillClient,
    WorkerKind.DECODE: DecodeClient,
    WorkerKind.ENCODER: VisionEncoderClient,  # health, and the images' cache_only prefetch
}


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the gRPC skeleton owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_worker(kind: WorkerKind, address: str, auth: Credentials | None = None) -> Worker:
    """A ``Worker`` at ``address``; its client sends ``auth`` (the internal token)."""
    return Worker(kind, address, CLIENTS[kind](address, auth=auth))


def make_workers(cfg: RouterConfig, auth: Credentials | None = None) -> list[Worker]:
    """One ``Worker`` per static address (discovery adds those of the ``dns:///`` names)."""
    return [
        make_worker(kind, address, auth)
        for kind, kind_addresses in cfg.workers.by_kind().items()
        for address in kind_addresses
        if parse_dns_name(address) is None
    ]


def _image_processor(model_dir: Path) -> ImageProcessor | None:
    """The checkpoint's image processor (the grids of the images prefetched before
    tokenization), or None for a model without one."""
    if not (model_dir / "preprocessor_config.json").is_file():
        return None
    return ImageProcessor.from_dir(model_dir)


class RouterApp:
    def __init__(
        self,
        cfg: RouterConfig,
        metrics: RouterMetrics,
        text: TextProcessor,
        images: ImageLoader | None = None,
        access: RouterAccess | None = None,
        resolver: BaseResolver | None = None,
    ) -> None:
        access = access if access is not None else RouterAccess()
        self.cfg = cfg
        self.metrics = metrics
        self.health = HealthState()
        self.registry = WorkerRegistry(
            make_workers(cfg, access.internal),
            make_policy(cfg.policy, cfg.cache_aware_max_imbalance),
            metrics,
            HealthProbe(cfg.health_timeout_s, auth=access.internal),
            on_poll=self._update_health,
            required_kinds=[k for k, a in cfg.workers.by_kind().items() if a],
            readmit_passes=cfg.health_readmit_passes,
            eject_timeouts=cfg.health_eject_timeouts,
        )
        self.discovery = WorkerDiscovery(
            self.registry,
            cfg.workers.by_kind(),
            functools.partial(make_worker, auth=access.internal),
            resolver or SystemResolver(),
            cfg.workers.discovery_interval_s,
        )
        limits = cfg.limits
        self.pipeline = GenerationPipeline(
            self.registry,
            text.detokenizer,  # each request's, with its skip_special_tokens
            cfg.max_context_len,
            metrics,
            limits.default_max_tokens,
            flow=cfg.flow,
            model_name=cfg.served_model_name,
            prefetch_images=cfg.prefetch_images,
            image_processor=_image_processor(cfg.model),
            grammars=GrammarChecker(cfg.model, limits.grammar_compile_timeout_s),
        )
        self.health_generate = None
        if cfg.health_generate_interval_s > 0:
            self.health_generate = HealthGenerateChecker(
                self.registry,
                self.pipeline,
                cfg.health_generate_interval_s,
                cfg.health_generate_timeout_s,
            )
        self.images = images or ImageLoader.from_limits(limits)
        self.api = self._openai_api(text)
        self.http_app: FastAPI = create_app(self.api)
        require_api_key(self.http_app, access.api_key)
        self.grpc_server, self.grpc_port = self._grpc_server(access)
        self._http_server: _EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task | None = None

    def _openai_api(self, text: TextProcessor) -> OpenAIApi:
        cfg, limits = self.cfg, self.cfg.limits
        return OpenAIApi(
            self.pipeline,
            self.registry,
            self.images,
            self.metrics,
            cfg.served_model_name,
            cfg.max_context_len,
            ApiLimits(
                limits.request_timeout_s,
                limits.max_stop_strings,
                limits.max_request_bytes,
                limits.max_n,
                one_prefill=not cfg.disable_prefix_cache,
            ),
            text,
            resolve_tool_format(cfg.tool_call_parser, cfg.model),
        )

    def _grpc_server(self, access: RouterAccess) -> tuple[grpc.aio.Server, int]:
        cfg, limits = self.cfg, self.cfg.limits
        servicer = RouterServicer(
            self.pipeline,
            self.metrics,
            cfg.served_model_name,
            ServicerLimits(
                limits.request_timeout_s,
                limits.max_stop_strings,
                limits.max_image_bytes,
                cfg.max_context_len,
                limits.max_n,
                one_prefill=not cfg.disable_prefix_cache,
            ),
            self.images,
            self.api.tool_format,
        )
        return create_server(
            [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
            cfg.port,
            cfg.host,
            [SERVICE_NAME],
            health=self.health,
            auth=access.api_key,
            enable_reflection=access.enable_reflection,
        )

    @classmethod
    def build(
        cls,
        cfg: RouterConfig,
        metrics: RouterMetrics | None = None,
        images: ImageLoader | None = None,
        access: RouterAccess | None = None,
        resolver: BaseResolver | None = None,
    ) -> RouterApp:
        """A router detokenizing locally with the model directory's tokenizer.

        ``access``: API key, internal token and reflection (default: none of them);
        ``resolver``: what the ``dns:///`` worker addresses resolve through (default: the
        system's).
        """
        if metrics is None:
            metrics = RouterMetrics(
                max_latency_s=cfg.limits.request_timeout_s, max_model_len=cfg.max_context_len
            )
        return cls(cfg, metrics, TextProcessor.from_dir(cfg.model), images, access, resolver)

    def _update_health(self) -> None:
        self.health.set_serving(self.registry.is_ready)

    async def start(self, http_socket: socket.socket | None) -> None:
        """Start gRPC (and HTTP on ``http_socket`` unless None), poll the workers once, keep polling."""
        await self.grpc_server.start()
        if http_socket is not None:
            limits = replace(
                self.cfg.http, max_connections=connection_budget(self.cfg.http.max_connections)
            )
            config = uvicorn.Config(
                self.http_app,
                http=protocol_class(limits),  # type: ignore[arg-type]
                backlog=ACCEPT_BATCH,
                ws="none",  # no WebSocket routes: an Upgrade request is served as plain HTTP
                lifespan="off",
                access_log=False,
                log_level=self.cfg.log_level.lower(),
                # uvicorn's loggers go through the service's handler (--log-format)
                log_config=None,
                timeout_graceful_shutdown=HTTP_GRACE_S,
            )
            self._http_server = _EmbeddedUvicorn(config)
            self._http_task = asyncio.create_task(
                self._http_server.serve(sockets=[http_socket]), name="http"
            )
            while not self._http_server.started:
                if self._http_task.done():
                    await self._http_task  # raises why it failed
                    raise RuntimeError("the HTTP server stopped during start-up")
                await asyncio.sleep(0.01)
            http_socket.listen(LISTEN_BACKLOG)  # the kernel's queue; asyncio's batch stays
        await self.discovery.refresh()
        await self.registry.poll_once()
        self.registry.start(self.cfg.health_interval_s)
        self.discovery.start()
        if self.health_generate is not None:
            self.health_generate.start()

    async def drain(self) -> None:
        """SIGTERM (health is NOT_SERVING already): refuse new requests (503 / UNAVAILABLE,
        ``GET /health`` 503), give the ones in flight ``cfg.drain_s`` to finish, then end the
        rest with UNAVAILABLE. Both servers keep serving meanwhile."""
        self.pipeline.tasks.start_drain()
        if self.health_generate is not None:
            await self.health_generate.close()
        await self.pipeline.tasks.finish_drain(self.cfg.drain_s)

    async def stop(self) -> None:
        """Release everything (the gRPC server is already stopped by the skeleton)."""
        if self._http_server is not None and self._http_task is not None:
            self._http_server.should_exit = True
            await self._http_task
        if self.health_generate is not None:
            await self.health_generate.close()
        await self.pipeline.tasks.wait_idle(ABORTS_S)
        await self.discovery.close()
        await self.registry.close()
        await self.images.close()
        if self.pipeline.grammars is not None:
            self.pipeline.grammars.close()
