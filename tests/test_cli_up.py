"""``stageserve up``: the flags each service gets (``--kv-transfer-backend`` and the fault
bounds only when set; per-service devices), the config the CLI builds, and the ready table."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from services import launcher as launcher_module
from services.cli import build_parser, main
from services.common.paths import BUNDLED_MODEL
from services.launch_spec import LaunchConfig, common_args
from tests.launch_fakes import child_configs, service_args


def test_up_parses_the_flag() -> None:
    assert build_parser().parse_args(["up"]).kv_transfer_backend is None
    assert (
        build_parser().parse_args(["up", "--kv-transfer-backend", "cuda_ipc"]).kv_transfer_backend
        == "cuda_ipc"
    )


@pytest.mark.parametrize("name", ["nccl", "rdma"])
def test_up_rejects_other_names(name, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--kv-transfer-backend", name])
    assert "choose from mooncake, inprocess, cuda_ipc" in capsys.readouterr().err.replace("'", "")


def test_up_rejects_cuda_ipc_on_the_cpu_before_starting_anything(capsys) -> None:
    assert main(["up", "--port", "0", "--kv-transfer-backend", "cuda_ipc"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--transfer-backend", "--kv-transfer-backend"])
def test_up_rejects_inprocess_before_starting_anything(flag, capsys) -> None:
    assert main(["up", "--port", "0", flag, "inprocess"]) == 2
    assert "up runs every service as its own process: use one of" in capsys.readouterr().err


def test_kv_flag_reaches_prefill_and_decode_only_when_set(monkeypatch) -> None:
    cfg = LaunchConfig(BUNDLED_MODEL, transfer_backend="shm", kv_transfer_backend="mooncake")
    configs = child_configs(cfg, monkeypatch)
    for name in ("prefill", "decode"):
        assert (configs[name].transfer_backend, configs[name].kv_transfer_backend) == (
            "shm",
            "mooncake",
        )
    assert configs["vision_encoder"].transfer_backend == "shm"
    args = service_args(cfg, monkeypatch)
    assert [n for n, a in args.items() if "--kv-transfer-backend" in a] == ["decode", "prefill"]
    configs = child_configs(LaunchConfig(BUNDLED_MODEL, transfer_backend="shm"), monkeypatch)
    assert configs["prefill"].kv_transfer_backend is configs["decode"].kv_transfer_backend is None
    assert configs["prefill"].transfer_backend == configs["decode"].transfer_backend == "shm"


def test_the_prefix_cache_flags_reach_prefill(monkeypatch) -> None:
    """``--disable-prefix-cache`` reaches the router too: its ``n`` choices then start at once
    (``services/router/choices.py``)."""
    configs = child_configs(LaunchConfig(BUNDLED_MODEL), monkeypatch)
    assert not configs["prefill"].disable_prefix_cache and configs["prefill"].host_cache_gb == 0
    assert not configs["router"].disable_prefix_cache
    cfg = LaunchConfig(
        BUNDLED_MODEL, disable_prefix_cache=True, host_cache_gb=1.5, prefill_num_pages=4096
    )
    configs = child_configs(cfg, monkeypatch)
    assert configs["prefill"].disable_prefix_cache and configs["prefill"].host_cache_gb == 1.5
    assert configs["router"].disable_prefix_cache
    assert configs["prefill"].num_pages == 4096 and configs["decode"].num_pages is None
    args = service_args(cfg, monkeypatch)
    assert [n for n, a in args.items() if "--host-cache-gb" in a] == ["prefill"]
    assert sorted(n for n, a in args.items() if "--disable-prefix-cache" in a) == [
        "prefill",
        "router",
    ]


def up_configs(monkeypatch, *argvs: list[str]) -> list[LaunchConfig]:
    """The config ``up`` would launch for each argv (no process started); torch sees one GPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    for argv in argvs:
        assert main(["up", "--port", "0", *argv]) == 0
    return configs


def test_up_moves_embeddings_over_cuda_ipc_when_the_kv_does_and_both_ends_are_gpus(
    monkeypatch,
) -> None:
    gpu_kv = ["--device", "cuda", "--kv-transfer-backend", "cuda_ipc"]
    configs = up_configs(
        monkeypatch,
        gpu_kv,
        [*gpu_kv, "--encoder-device", "cpu"],  # the encoder's rows start in host memory
        [*gpu_kv, "--transfer-backend", "shm"],  # the user's choice stands
        [],  # the CPU default
    )
    assert [c.transfer_backend for c in configs] == ["cuda_ipc", "shm", "shm", "shm"]
    assert [c.kv_transfer_backend for c in configs] == ["cuda_ipc"] * 3 + ["shm"]
    args = service_args(configs[0], monkeypatch)
    for name in ("vision_encoder", "prefill"):
        assert _flag(args[name], "--transfer-backend") == "cuda_ipc"


@pytest.mark.parametrize(
    "argv",
    [
        ["--transfer-backend", "cuda_ipc"],
        ["--device", "cuda", "--encoder-device", "cpu", "--transfer-backend", "cuda_ipc"],
    ],
)
def test_up_refuses_cuda_ipc_embeddings_off_a_gpu(argv, monkeypatch, capsys) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: pytest.fail("started"))
    assert main(["up", "--port", "0", *argv]) == 2
    assert (
        "error: the cuda_ipc embedding transfer backend moves rows between GPUs of one host "
        "and needs the vision encoder and prefill on CUDA devices, got 'cpu'"
    ) in capsys.readouterr().err


FAULT_FLAGS = {
    "router": "--stall-timeout-s",
    "decode": "--kv-quarantine-s",
    "prefill": "--embedding-quarantine-s",
}


def test_fault_bounds_reach_their_service_only_when_given(monkeypatch) -> None:
    cfg = LaunchConfig(
        Path("m"), stall_timeout_s=3.0, kv_quarantine_s=2.0, embedding_quarantine_s=0.0
    )
    args = service_args(cfg, monkeypatch)
    assert {name: args[name][args[name].index(flag) + 1] for name, flag in FAULT_FLAGS.items()} == {
        "router": "3.0",
        "decode": "2.0",
        "prefill": "0.0",
    }
    for name, flag in FAULT_FLAGS.items():  # each flag reaches its own service and no other
        assert [n for n, a in args.items() if flag in a] == [name]
    defaults = service_args(LaunchConfig(Path("m")), monkeypatch)
    assert not [f for a in defaults.values() for f in a if f in FAULT_FLAGS.values()]


def test_watchdog_bounds_reach_prefill_and_decode_only_when_given(monkeypatch) -> None:
    cfg = LaunchConfig(
        Path("m"), prefill_step_timeout_s=12.0, prefill_watchdog_s=9.0, decode_watchdog_s=8.0
    )
    args = service_args(cfg, monkeypatch)

    def value(service: str, flag: str) -> str:
        return args[service][args[service].index(flag) + 1]

    assert value("prefill", "--step-timeout-s") == "12.0"
    assert (value("prefill", "--watchdog-s"), value("decode", "--watchdog-s")) == ("9.0", "8.0")
    assert sorted(n for n, a in args.items() if "--watchdog-s" in a) == ["decode", "prefill"]
    defaults = service_args(LaunchConfig(Path("m")), monkeypatch)
    assert not [
        f for a in defaults.values() for f in a if f in ("--watchdog-s", "--step-timeout-s")
    ]


ADMISSION_FLAGS = ("--max-concurrent-requests", "--max-queued-requests", "--queue-timeout-s")


def test_admission_limits_reach_the_router_only_when_given(monkeypatch) -> None:
    cfg = LaunchConfig(
        Path("m"), max_concurrent_requests=8, max_queued_requests=0, queue_timeout_s=5.0
    )
    args = service_args(cfg, monkeypatch)
    assert [args["router"][args["router"].index(f) + 1] for f in ADMISSION_FLAGS] == [
        "8",
        "0",
        "5.0",
    ]
    # prefill's own queue holds every request the routers admit: 8 slots here
    assert _flag(args["prefill"], "--max-queued-requests") == "8"
    assert [n for n, a in args.items() if any(f in a for f in ADMISSION_FLAGS)] == [
        "prefill",
        "router",
    ]
    defaults = service_args(LaunchConfig(Path("m"), router_workers=3), monkeypatch)
    given = [f for n, a in defaults.items() if n != "prefill" for f in a if f in ADMISSION_FLAGS]
    assert given == []  # the routers keep their own defaults
    assert _flag(defaults["prefill"], "--max-queued-requests") == str(3 * 256)


ROUTER_API_FLAGS = ("--tool-call-parser", "--max-n")


@pytest.mark.parametrize("router_workers", [1, 2])
def test_router_api_flags_reach_every_router_only_when_given(monkeypatch, router_workers) -> None:
    args = build_parser().parse_args(["up", "--tool-call-parser", "qwen3_coder", "--max-n", "3"])
    assert (args.tool_call_parser, args.max_n) == ("qwen3_coder", 3)
    cfg = LaunchConfig(
        BUNDLED_MODEL, tool_call_parser="qwen3_coder", max_n=3, router_workers=router_workers
    )
    configs = child_configs(cfg, monkeypatch)
    assert (configs["router"].tool_call_parser, configs["router"].limits.max_n) == (
        "qwen3_coder",
        3,
    )
    given = service_args(cfg, monkeypatch)
    routers = ["router", *(f"router-{i}" for i in range(2, router_workers + 1))]
    for name in routers:  # every router process, the first and the others
        assert [_flag(given[name], f) for f in ROUTER_API_FLAGS] == ["qwen3_coder", "3"]
    assert [n for n, a in given.items() if any(f in a for f in ROUTER_API_FLAGS)] == routers
    defaults = service_args(LaunchConfig(BUNDLED_MODEL), monkeypatch)
    assert not [f for a in defaults.values() for f in a if f in ROUTER_API_FLAGS]
    configs = child_configs(LaunchConfig(BUNDLED_MODEL), monkeypatch)
    assert (configs["router"].tool_call_parser, configs["router"].limits.max_n) == ("auto", 8)


@pytest.mark.parametrize(
    "argv", [["--tool-call-parser", "mistral"], ["--max-n", "0"], ["--max-n", "x"]]
)
def test_router_api_flags_refuse_bad_values(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", *argv])
    assert argv[0] in capsys.readouterr().err


def test_decode_batch_holds_every_request_the_routers_admit(monkeypatch) -> None:
    def batch(**fields) -> int:
        cfg = LaunchConfig(BUNDLED_MODEL, **fields)
        return child_configs(cfg, monkeypatch)["decode"].max_running_requests

    assert batch() == 256  # one router's 256 slots: decode's own default
    assert batch(router_workers=2) == 512
    assert batch(router_workers=2, max_concurrent_requests=300, decode_dp=2) == 300
    assert batch(router_workers=3, max_concurrent_requests=100, decode_dp=2) == 256
    assert batch(router_workers=4, decode_device="cpu,cpu,cpu") == -(-1024 // 3)
    assert batch(router_workers=4, max_running_requests=64) == 64
    args = build_parser().parse_args(["up", "--max-running-requests", "96"])
    assert args.max_running_requests == 96


def _flag(args: list[str] | tuple[str, ...], flag: str) -> str:
    [value] = [args[i + 1] for i, a in enumerate(args) if a == flag]
    return value


def test_up_turns_the_fault_flags_into_the_config(monkeypatch) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert (
        main(
            [
                "up",
                "--port",
                "0",
                "--stall-timeout-s",
                "3",
                "--kv-quarantine-s",
                "2",
                "--embedding-quarantine-s",
                "1.5",
                "--max-concurrent-requests",
                "8",
                "--max-queued-requests",
                "4",
                "--queue-timeout-s",
                "5",
                "--transfer-backend",
                "shm",
            ]
        )
        == 0
    )
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 0
    given, default = configs

    def bounds(cfg: LaunchConfig) -> tuple:
        return (
            cfg.stall_timeout_s,
            cfg.kv_quarantine_s,
            cfg.embedding_quarantine_s,
            cfg.max_concurrent_requests,
            cfg.max_queued_requests,
            cfg.queue_timeout_s,
        )

    assert bounds(given) == (3.0, 2.0, 1.5, 8, 4, 5.0)
    assert bounds(default) == (None,) * 6


def test_each_model_service_can_get_its_own_device() -> None:
    args = build_parser().parse_args(["up", "--device", "cuda:0", "--decode-device", "cuda:1"])
    assert (args.device, args.encoder_device, args.prefill_device, args.decode_device) == (
        "cuda:0",
        None,
        None,
        "cuda:1",
    )
    cfg = LaunchConfig(Path("m"), device="cuda:0", decode_device="cuda:1", encoder_device="cuda:2")

    def device(name: str) -> str:
        flags = common_args(cfg, name)
        return flags[flags.index("--device") + 1]

    assert [device(n) for n in ("tokenizer", "vision_encoder", "prefill", "decode", "router")] == [
        "cuda:0",
        "cuda:2",
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]


def test_up_checks_the_kv_backend_against_both_ends_devices(capsys, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # cuda:0 and cuda:1
    assert (
        main(
            [
                "up",
                "--port",
                "0",
                "--device",
                "cuda:0",
                "--decode-device",
                "cpu",
                "--kv-transfer-backend",
                "cuda_ipc",
            ]
        )
        == 2
    )
    assert "needs a CUDA device (--device cuda), got 'cpu'" in capsys.readouterr().err
    assert (
        main(
            ["up", "--port", "0", "--prefill-device", "cuda:1", "--kv-transfer-backend", "mooncake"]
        )
        == 2
    )  # -non-cuda build
    assert "moves host memory only and the KV pool is on 'cuda:1'" in capsys.readouterr().err


def test_log_format_reaches_every_service(monkeypatch, capsys) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    monkeypatch.delenv("STAGESERVE_LOG_FORMAT", raising=False)
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 0
    assert main(["up", "--port", "0", "--transfer-backend", "shm", "--log-format", "json"]) == 0
    monkeypatch.setenv("STAGESERVE_LOG_FORMAT", "json")
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 0
    assert [c.log_format for c in configs] == ["text", "json", "json"]
    for name in ("tokenizer", "vision_encoder", "prefill", "decode", "router"):
        flags = common_args(configs[1], name)
        assert flags[flags.index("--log-format") + 1] == "json"
    monkeypatch.setenv("STAGESERVE_LOG_FORMAT", "xml")
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 2
    assert "STAGESERVE_LOG_FORMAT must be one of text, json, got 'xml'" in capsys.readouterr().err


def test_up_refuses_an_otel_setting_before_starting_anything(monkeypatch, capsys) -> None:
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: pytest.fail("started"))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    assert main(["up", "--port", "0", "--transfer-backend", "shm"]) == 2
    assert "OTEL_TRACES_EXPORTER: unsupported exporter 'zipkin'" in capsys.readouterr().err


def test_the_ready_table_shows_every_services_metrics_address() -> None:
    def child(name: str, pid: int, **ready: str) -> SimpleNamespace:
        return SimpleNamespace(name=name, process=SimpleNamespace(pid=pid), ready=ready)

    lines = launcher_module.ready_table(
        "127.0.0.1",
        [
            child("tokenizer", 11, port="5001", metrics_port="9100"),
            child("router", 15, port="5005", metrics_port="9104", http_port="8000"),
        ],
    )
    assert lines[0].split() == ["service", "pid", "grpc", "metrics"]
    assert lines[1].split() == ["tokenizer", "11", "5001", "http://127.0.0.1:9100/metrics"]
    assert lines[2].split() == [
        "router",
        "15",
        "5005",
        "http://127.0.0.1:9104/metrics",
        "(HTTP",
        "port",
        "8000)",
    ]
