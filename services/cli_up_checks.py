"""What ``stageserve up`` checks before it starts anything: each check names the cause
(``ValueError``), so ``up`` fails at once instead of as a service that exits before READY."""

from __future__ import annotations

import dataclasses
import socket

from services.common.exposure import (
    MOONCAKE_EXPOSURE,
    ExposureError,
    check_transfer_exposure,
    is_loopback_host,
)
from services.common.kv_transfer import (
    BACKENDS,
    check_cross_process,
    check_embedding_backend,
    check_kv_backend,
    lookup_backend,
    resolve_kv_backend,
)
from services.common.logs import LOG_FORMATS
from services.launch_config import LaunchConfig
from services.launch_spec import decode_devices, device_of

ONE_PROCESS_EACH = "up runs every service as its own process"


def check_model_and_port(cfg: LaunchConfig) -> None:
    """The model directory has a ``config.json``; the HTTP port (unless 0) is free."""
    if not (cfg.model / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {cfg.model}")
    if cfg.http_port:
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((cfg.host, cfg.http_port))
            except OSError as exc:
                raise ValueError(
                    f"cannot bind the HTTP port {cfg.host}:{cfg.http_port}: {exc.strerror}"
                ) from None


def check_log_format(log_format: str) -> None:
    """``--log-format`` checks its own value; its default comes from ``STAGESERVE_LOG_FORMAT``."""
    if log_format not in LOG_FORMATS:
        formats = ", ".join(LOG_FORMATS)
        raise ValueError(f"STAGESERVE_LOG_FORMAT must be one of {formats}, got {log_format!r}")


def check_decode_dp(cfg: LaunchConfig) -> None:
    """``--decode-dp`` agrees with a ``--decode-device`` list (one rank process on each device,
    ``--decode-tp`` of them per DP rank)."""
    num_decode_devices = len(decode_devices(cfg))
    if num_decode_devices > 1 and cfg.decode_dp not in (1, num_decode_devices // cfg.decode_tp):
        raise ValueError(
            f"--decode-dp {cfg.decode_dp} disagrees with --decode-device "
            f"({num_decode_devices} devices"
            + (f", --decode-tp {cfg.decode_tp})" if cfg.decode_tp > 1 else ")")
        )


def check_prefill_cp(cfg: LaunchConfig) -> None:
    """``ValueError`` naming ``--prefill-cp`` (or its block size) when prefill could not start
    with it."""
    from services.common.rank_devices import rank_devices
    from services.prefill.config import check_block_tokens

    device = device_of(cfg, "prefill")
    rank_devices(
        (),
        cfg.prefill_ranks,
        device,
        spread_cuda=True,
        service="prefill",
        flag=cfg.prefill_ranks_flag,
    )
    if cfg.prefill_cp_block_tokens is not None:
        check_block_tokens(cfg.prefill_cp_block_tokens, cfg.page_size)


def check_tensor_parallel(cfg: LaunchConfig) -> None:
    """``ValueError`` naming the numbers when the encoder's, prefill's or decode's ranks could
    not split the model (``--encoder-tp``, ``--prefill-tp`` / ``--prefill-ep``, ``--decode-tp``
    / ``--decode-ep``), or the KV backend cannot move KV between pools of different heads
    (``writes_head_slices``)."""
    from services.common.rank_devices import rank_devices
    from services.engine.parallel import check_rank_split
    from services.launch_spec import decode_processes, prefill_config
    from services.prefill.config import check_parallel
    from services.vision_encoder.config import check_tp_groups, check_vision_split

    devices = rank_devices(
        (),
        cfg.encoder_ranks,
        device_of(cfg, "vision_encoder"),
        spread_cuda=False,
        service="vision_encoder",
    )
    check_tp_groups(devices, cfg.encoder_tp)
    check_vision_split(cfg.model, cfg.encoder_tp)
    devices = rank_devices(
        (), cfg.prefill_ranks, device_of(cfg, "prefill"), spread_cuda=True, service="prefill"
    )
    check_parallel(dataclasses.replace(prefill_config(cfg), devices=tuple(devices)))
    listed = decode_devices(cfg)
    devices = rank_devices(
        listed if len(listed) > 1 else (),
        decode_processes(cfg),
        listed[0],
        spread_cuda=False,
        service="decode",
    )
    check_rank_split(
        cfg.model, devices, cfg.decode_tp, cfg.decode_ep, "decode", cfg.decode_dp_attention
    )
    backend = lookup_backend(cfg.kv_transfer_backend or cfg.transfer_backend)
    if cfg.prefill_tp != cfg.decode_tp and not backend.writes_head_slices:
        writers = ", ".join(n for n, b in BACKENDS.items() if b.writes_head_slices)
        raise ValueError(
            f"--prefill-tp {cfg.prefill_tp} and --decode-tp {cfg.decode_tp} hold different KV "
            f"heads per rank, and the {backend.name} KV backend moves whole pages: give both "
            f"the same --*-tp, or use one of: {writers}"
        )


def check_transfers(cfg: LaunchConfig) -> str | None:
    """The chosen embedding and KV backends cross processes and reach both ends' devices;
    returns the warning to print for Mooncake on a non-loopback host (``ExposureError``, a
    ``ValueError``, on a loopback one)."""
    check_cross_process(cfg.transfer_backend, ONE_PROCESS_EACH)
    check_embedding_backend(  # the two ends of the embedding rows
        cfg.transfer_backend, (device_of(cfg, "vision_encoder"), device_of(cfg, "prefill"))
    )
    for device in (device_of(cfg, "prefill"), *decode_devices(cfg)):  # the KV handoff's ends
        check_kv_backend(cfg.kv_transfer_backend, cfg.transfer_backend, device)
    kv_backend = resolve_kv_backend(cfg.kv_transfer_backend, cfg.transfer_backend)
    check_cross_process(kv_backend, ONE_PROCESS_EACH)
    return check_transfer_exposure(cfg.host, (cfg.transfer_backend, kv_backend))


def check_kv_store(cfg: LaunchConfig) -> str | None:
    """With ``--kv-store-gb``: prefill can use a store of that segment size, and
    ``mooncake_master`` is installed (``ValueError``); the store's clients (prefill's ranks)
    listen on every interface, so a loopback ``--host`` is refused (``ExposureError``) and
    any other gets the warning this returns. None without a store."""
    gb = cfg.kv_store_gb
    if not gb:
        return None
    from services.prefill.kv_store import MIN_SEGMENT_BYTES
    from services.prefill.kv_store_master import master_binary

    if cfg.disable_prefix_cache:
        raise ValueError(
            "--kv-store-gb is the prefix cache's third tier: not with --disable-prefix-cache"
        )
    if cfg.prefill_tp > 1:
        raise ValueError(
            f"--kv-store-gb with --prefill-tp {cfg.prefill_tp}: the store keeps whole pages, "
            "and a tensor-parallel rank holds some of each page's KV heads"
        )
    if gb * 1e9 < MIN_SEGMENT_BYTES:
        raise ValueError(
            f"--kv-store-gb must be 0 or at least {MIN_SEGMENT_BYTES / 1e9:g} (Mooncake's "
            f"smallest segment), got {gb:g}"
        )
    try:
        master_binary()
    except FileNotFoundError:
        raise ValueError(
            "--kv-store-gb starts a mooncake_master, which is not installed (neither in the "
            "mooncake package nor on PATH): install stageserve's cpu or gpu extra (bash "
            "scripts/install.sh cpu, or gpu; it also installs libibverbs1 librdmacm1 libnuma1)"
        ) from None
    if is_loopback_host(cfg.host):
        raise ExposureError(
            f"--kv-store-gb cannot stay on --host {cfg.host}: {MOONCAKE_EXPOSURE} (prefill's "
            "store clients); give a non-loopback --host and fence Mooncake's ports off "
            "(firewall, NetworkPolicy), or keep evicted pages in host memory (--host-cache-gb)"
        )
    return check_transfer_exposure(cfg.host, ("mooncake",))
