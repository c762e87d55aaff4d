"""Wires a decode service from its config: D free-running rank groups of one process each, the
leader, gRPC."""

from __future__ import annotations

import functools
from collections.abc import Callable

from services.common import signing
from services.common.auth import Credentials
from services.common.envs import Envs
from services.common.pb.stageserve.v1 import decode_pb2_grpc
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.free_supervisor import Reported
from services.common.ranks.group import RankGroup
from services.common.server import HealthState, serve_until_signal
from services.common.service_main import print_ready, service_server, start_telemetry
from services.decode.config import DecodeConfig
from services.decode.dp_views import SharedGroup
from services.decode.leader import DecodeLeader
from services.decode.messages import DpReports, RankInit, RankReport
from services.decode.rank_views import MakeRank, RankHandle
from services.decode.servicer import SERVICE_NAME, DecodeServicer

RANK_STEP = "services.decode.rank_step:DecodeRankStep"
DP_ATTENTION_STEP = "services.decode.dp_attention:DpAttentionRankStep"


def rank_init(config: DecodeConfig) -> RankInit:
    """What every rank builds itself from."""
    return RankInit(
        model=str(config.model),
        dtype=config.dtype,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
        num_pages=config.num_pages,
        gpu_memory_utilization=config.rank_memory_fraction,
        page_size=config.page_size,
        max_model_len=config.max_model_len,
        max_running_requests=config.max_running_requests,
        attention_backend=config.attention_backend,
        kv_backend=config.kv_backend,
        transfer_host=config.transfer_host or config.host,
        kv_quarantine_s=config.kv_quarantine_s,
        gpu_share_file=config.gpu_share_file,
        prefill_first_s=config.prefill_first_s,
        tp_size=config.tp,
        ep_size=config.ep,
        dp_attention=config.dp_attention,
    )


def process_ranks(config: DecodeConfig, envs: Envs) -> MakeRank:
    """Rank ``r`` is a free-running rank group of ``config.tp`` processes on
    ``config.devices[r*T : (r+1)*T]`` (one without TP), restarted alone; with
    ``config.dp_attention``, every rank is a view of one group of D processes
    (``dp_views.py``), which fails and re-forms as a whole."""
    init = rank_init(config)
    devices, tp = config.devices, config.tp
    if config.dp_attention:
        group_config = RankGroupConfig(
            name=f"decode DP-attention group of {len(devices)}",
            devices=devices,
            step_timeout_s=config.watchdog_s,
            watchdog_s=config.watchdog_s,
            internal_token=envs.internal_token,
            is_free_running=True,
        )
        shared = SharedGroup(
            len(devices),
            lambda on_ready, on_report: RankGroup(
                group_config,
                StepSpec(DP_ATTENTION_STEP, DpReports, init),
                on_ready_change=on_ready,
                on_report=on_report,
            ),
        )
        return shared.view

    def make(
        dp_rank: int,
        on_ready_change: Callable[[bool], None],
        on_report: Callable[[Reported], None],
    ) -> RankHandle:
        group_config = RankGroupConfig(
            name=f"decode rank {dp_rank}",
            devices=devices[dp_rank * tp : (dp_rank + 1) * tp],
            step_timeout_s=config.watchdog_s,
            watchdog_s=config.watchdog_s,
            internal_token=envs.internal_token,  # what the spawned rank reads from its environment
            is_free_running=True,
        )
        return RankGroup(
            group_config,
            StepSpec(RANK_STEP, RankReport, init),
            on_ready_change=on_ready_change,
            on_report=on_report,
        )

    return make


async def serve(config: DecodeConfig, envs: Envs, auth: Credentials | None) -> None:
    """Serve until SIGTERM: liveness at once, readiness once a rank is formed and warm; on
    SIGTERM, NOT_SERVING, then the leader's drain (``config.drain_s``), then the stop."""
    metrics_port = start_telemetry(
        "decode", envs, config.host, config.metrics_port, model_name=config.model.resolve().name
    )
    health = HealthState()
    servicer = DecodeServicer(
        config.reservation_timeout_s,
        config.max_reservation_s,
        signing.key_of(auth.token if auth else ""),
    )
    server, port = service_server(
        (decode_pb2_grpc.add_DecodeServicer_to_server, servicer), SERVICE_NAME, config, health, auth
    )
    await server.start()  # liveness answers (NOT_SERVING) while the ranks form
    leader = DecodeLeader(
        config.dp_size,
        process_ranks(config, envs),
        config.watchdog_s,
        on_ready_change=health.set_serving,
    )
    servicer.attach(leader)  # UNAVAILABLE ("no decode rank serves") until a rank has formed
    try:
        await leader.start()
    except BaseException:
        await server.stop(None)
        raise
    print_ready("decode", port=port, metrics_port=metrics_port)
    await serve_until_signal(
        server, health, leader.stop, drain=functools.partial(leader.drain, config.drain_s)
    )
