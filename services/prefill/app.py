"""Wiring of one prefill worker: the scheduler, the rank group (C CP ranks x T TP ranks, one
process each), the leader, gRPC.

The leader's process loads no weights and touches no device: the model, the local KV
pools, the KV senders and the embedding receivers live in the rank processes
(``rank_step.PrefillRankStep``), one per entry of ``config.devices``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

import torch

from services.common import signing
from services.common.auth import Credentials
from services.common.client import create_channel, wait_ready
from services.common.clients.vision_encoder import VisionEncoderClient
from services.common.envs import Envs
from services.common.kv_transfer import (
    check_cross_host,
    check_cross_process,
    check_embedding_backend,
    check_kv_backend,
)
from services.common.pb.stageserve.v1 import prefill_pb2_grpc
from services.common.rank_devices import local_devices, shares_a_device
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import print_ready, service_server, start_telemetry
from services.engine.config import ModelConfig
from services.prefill import metrics
from services.prefill.config import PrefillConfig, check_parallel, joining_address
from services.prefill.encoding import Encoder
from services.prefill.image_store import ImageStore
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.kv_store import MIN_SEGMENT_BYTES, KvStore, PageLayout
from services.prefill.leader import LeaderOptions, PrefillLeader
from services.prefill.messages import RankResult
from services.prefill.planning import CpPolicy
from services.prefill.prefix_cache import PrefixIndex
from services.prefill.rank_step import PrefillRankInit
from services.prefill.scheduler import PrefillScheduler
from services.prefill.servicer import SERVICE_NAME, PrefillServicer
from services.prefill.store_tier import StoreLookup, model_namespace
from services.transfer.embeddings import EmbeddingRowManager

logger = logging.getLogger(__name__)
STEP_TARGET = "services.prefill.rank_step:PrefillRankStep"
STORE_LOOKUP_TIMEOUT_S = 1.0  # a request waits this long at most for the shared store's answer


def check_backends(config: PrefillConfig) -> tuple[str, str]:
    """``(embedding backend, KV backend)`` the ranks run; ``ValueError`` for one they cannot."""
    embedding = check_embedding_backend(config.transfer_backend, local_devices(config.devices))
    kv_backend = check_kv_backend(
        config.kv_transfer_backend, config.transfer_backend, config.devices[0]
    )
    for name in (embedding, kv_backend):
        check_cross_process(name, "prefill's ranks are rank processes of their own")
        if joining_address(config) is not None:
            check_cross_host(name, "prefill has ranks on other hosts ('join' devices)")
    return embedding, kv_backend


def rank_init(config: PrefillConfig) -> PrefillRankInit:
    """What every rank builds itself from; ``ValueError`` for a backend or a ``--tp`` /
    ``--ep`` the service cannot run."""
    embedding, kv_backend = check_backends(config)
    check_parallel(config)
    return PrefillRankInit(
        model=str(config.model),
        dtype=config.dtype,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        num_pages=config.num_pages,
        page_size=config.page_size,
        embedding_rows=config.embedding_rows,
        attention_backend=config.attention_backend,
        transfer_backend=embedding,
        kv_backend=kv_backend,
        transfer_hostname=config.advertised_hostname,
        kv_exchange_over_cpu=shares_a_device(config.devices),
        cuda_graph_max_tokens=config.cuda_graph_max_tokens,
        gpu_share_file=config.gpu_share_file,
        host_cache_gb=0.0 if config.disable_prefix_cache else config.host_cache_gb,
        tp_size=config.tp,
        ep_size=config.ep,
        **store_init(config),
    )


def store_init(config: PrefillConfig) -> dict[str, object]:
    """The ranks' settings of the shared KV store (none with the prefix cache off)."""
    if not config.kv_store_master:
        return {}
    if config.disable_prefix_cache:
        raise ValueError(
            "--kv-store-master is the prefix cache's tier: not with --disable-prefix-cache"
        )
    host, _, port = config.kv_store_master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--kv-store-master must be HOST:PORT, got {config.kv_store_master!r}")
    segment_bytes = int(config.kv_store_segment_gb * 1e9)
    if 0 < segment_bytes < MIN_SEGMENT_BYTES:
        raise ValueError(
            f"--kv-store-segment-gb must be 0 or at least {MIN_SEGMENT_BYTES / 1e9:g} (Mooncake's "
            f"smallest segment), got {config.kv_store_segment_gb:g}"
        )
    return {
        "kv_store_master": config.kv_store_master,
        "kv_store_segment_bytes": segment_bytes,
        "kv_store_namespace": model_namespace(config.model),
    }


def store_lookup(config: PrefillConfig, leader: list[PrefillLeader]) -> StoreLookup | None:
    """The leader's lookup in the shared KV store; its client connects at the first lookup,
    with the page layout the ranks described."""
    if config.disable_prefix_cache or not config.kv_store_master:
        return None

    def connect() -> KvStore:
        layout = leader[0].descriptions[0].kv_layout
        page = PageLayout(
            layout.num_layers,
            layout.page_size,
            layout.num_kv_heads,
            layout.head_dim,
            getattr(torch, layout.dtype),
        )
        return KvStore(
            config.kv_store_master,
            model_namespace(config.model),
            page,
            local_hostname=config.advertised_hostname,
            segment_bytes=0,  # the leader lends no memory: it only asks what the store holds
        )

    def failed(op: str) -> None:
        metrics.PREFIX_CACHE_STORE_FAILURES.labels(op).inc()

    return StoreLookup(connect, STORE_LOOKUP_TIMEOUT_S, failed)


def group_config(config: PrefillConfig, internal_token: str) -> RankGroupConfig:
    address = joining_address(config)
    where = {} if address is None else {"control_addr": f"tcp://{address[0]}:{address[1]}"}
    return RankGroupConfig(
        name="prefill",
        devices=config.devices,
        host="127.0.0.1" if address is None else address[0],
        **where,
        step_timeout_s=config.step_timeout_s,
        watchdog_s=config.watchdog_s,
        internal_token=internal_token,
    )


@dataclass
class PrefillApp:
    leader: PrefillLeader
    ranks: RankGroup

    @classmethod
    def build(
        cls,
        config: PrefillConfig,
        *,
        internal_token: str,
        encoder: Encoder | None = None,
        group: RankGroupConfig | None = None,
        step_target: str = STEP_TARGET,
        result_type: type[RankResult] = RankResult,
    ) -> PrefillApp:
        """Build every part (nothing starts); ``ValueError`` for a configuration that cannot run.

        ``group`` overrides the rank group's configuration; ``step_target`` and ``result_type``
        the ranks' step class and its result (a subclass that injects faults, in tests).
        """
        spec = StepSpec(step_target, result_type, rank_init(config))
        holder: list[PrefillLeader] = []
        ranks = RankGroup(
            group or group_config(config, internal_token),
            spec,
            on_ready_change=lambda is_ready: holder[0].on_group_ready(is_ready) if holder else None,
        )
        scheduler = PrefillScheduler(
            EmbeddingRowManager(config.embedding_rows),
            config.num_pages,
            config.page_size,
            config.max_batch_tokens,
            config.max_queued_requests,
            config.embedding_quarantine_s,
            prefix=None
            if config.disable_prefix_cache
            else PrefixIndex(config.cp_size, config.num_pages, config.page_size),
        )
        policy = CpPolicy(config.cp_block_tokens, config.cp_min_tokens, config.max_batch_tokens)
        options = LeaderOptions(policy, config.step_timeout_s, config.watchdog_s, config.tp)
        leader = PrefillLeader(
            scheduler,
            ranks,
            ModelConfig.from_dir(config.model),
            encoder,
            options,
            store=store_lookup(config, holder),
        )
        holder.append(leader)
        return cls(leader, ranks)

    async def start(self, peers_ready: Awaitable[None] | None = None) -> None:
        """Form the rank group (load, warm up) while ``peers_ready`` (the vision encoder turning
        SERVING, which loads a model too) is awaited, then start the leader: it serves only once
        both are done. The first failure raises (``RankStartError``, or the peer wait's), with
        the ranks stopped."""
        forming = asyncio.ensure_future(self.ranks.start())
        peers = asyncio.ensure_future(peers_ready) if peers_ready is not None else None
        waits = [forming] if peers is None else [forming, peers]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            for wait in done:
                wait.result()  # the first failure, whichever it was
            await self.leader.start()
        except BaseException:
            if peers is not None:
                peers.cancel()
            await self.ranks.aclose()  # a group still forming stops (never cancelled): it raises
            await asyncio.gather(*waits, return_exceptions=True)
            raise

    async def close(self) -> None:
        """Stop the leader (failing live requests), then the rank group."""
        await self.leader.stop()
        await self.ranks.aclose()
        if self.leader.store is not None:
            self.leader.store.close()


async def serve(config: PrefillConfig, envs: Envs, auth: Credentials | None) -> None:
    """Serve until SIGTERM: liveness at once, SERVING once the rank group formed; on SIGTERM,
    NOT_SERVING, then the leader's drain (``config.drain_s``), then the release."""
    metrics_port = start_telemetry(
        "prefill", envs, config.host, config.metrics_port, model_name=config.model.resolve().name
    )
    health = HealthState()
    kv_refs = KvRefVerifier(signing.key_of(auth.token if auth else ""), config.max_kv_ref_nonces)
    images = ImageStore(config.image_store_mb * 1024 * 1024)
    servicer = PrefillServicer(config.default_timeout_s, kv_refs, images)
    server, port = service_server(
        (prefill_pb2_grpc.add_PrefillServicer_to_server, servicer),
        SERVICE_NAME,
        config,
        health,
        auth,
    )
    await server.start()
    encoder = None
    if config.encoder_address:
        encoder = VisionEncoderClient(config.encoder_address, auth=auth)
    app = PrefillApp.build(config, internal_token=envs.internal_token, encoder=encoder)
    app.leader.on_serving = health.set_serving  # once the rank group formed and described itself
    await app.start(_wait_encoder_ready(config) if encoder is not None else None)
    servicer.attach(app.leader)
    app.leader.progress.start(health)  # readiness follows the ranks: NOT_SERVING while stuck
    print_ready("prefill", port=port, metrics_port=metrics_port)

    async def release() -> None:
        await app.close()
        if encoder is not None:
            await encoder.close()

    drain = functools.partial(app.leader.drain, config.drain_s)
    await serve_until_signal(server, health, release, drain=drain)


async def _wait_encoder_ready(config: PrefillConfig) -> None:
    channel = create_channel(config.encoder_address)
    try:
        await wait_ready(channel, config.peer_ready_timeout_s)
    finally:
        await channel.close()
