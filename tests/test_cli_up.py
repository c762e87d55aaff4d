"""``stageserve up``: the flags each service gets (``--kv-transfer-backend`` and the fault bounds only
when set; per-service devices) and the supervisor that restarts an exited service on its ports."""

from __future__ import annotations

import io
import itertools
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from services import launcher as launcher_module
from services.cli import build_parser, main
from services.launcher import (
    Child,
    ChildSpec,
    LaunchConfig,
    Launcher,
    RestartPolicy,
    Supervisor,
    common_args,
)


def service_args(cfg: LaunchConfig, monkeypatch) -> dict[str, list[str]]:
    """The flags ``start_all`` gives each service, without starting any process."""
    started: dict[str, list[str]] = {}

    def start(spec: ChildSpec) -> SimpleNamespace:
        started[spec.name] = list(spec.args)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1"
        )

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return started


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


def test_kv_flag_reaches_prefill_and_decode_only_when_set(monkeypatch) -> None:
    args = service_args(
        LaunchConfig(Path("m"), transfer_backend="mooncake", kv_transfer_backend="cuda_ipc"),
        monkeypatch,
    )
    for name in ("prefill", "decode"):
        assert args[name][:4] == [
            "--transfer-backend",
            "mooncake",
            "--kv-transfer-backend",
            "cuda_ipc",
        ]
    assert args["vision_encoder"] == ["--transfer-backend", "mooncake"]
    args = service_args(LaunchConfig(Path("m"), transfer_backend="inprocess"), monkeypatch)
    assert not any("--kv-transfer-backend" in a for a in args.values())
    assert args["prefill"][:2] == args["decode"][:2] == ["--transfer-backend", "inprocess"]


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
    assert [c.kv_transfer_backend for c in configs] == ["cuda_ipc"] * 3 + [None]
    args = service_args(configs[0], monkeypatch)
    for name in ("vision_encoder", "prefill"):
        assert args[name][:2] == ["--transfer-backend", "cuda_ipc"]


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
        "error: the cuda_ipc embedding transfer backend moves rows between GPUs of one host and needs the "
        "vision encoder and prefill on CUDA devices, got 'cpu'"
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
    assert [n for n, a in args.items() if any(f in a for f in ADMISSION_FLAGS)] == ["router"]
    defaults = service_args(LaunchConfig(Path("m")), monkeypatch)
    assert not [f for a in defaults.values() for f in a if f in ADMISSION_FLAGS]


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


def test_up_checks_the_kv_backend_against_both_ends_devices(capsys) -> None:
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


# ------------------------------------------------------------------ supervision


class FakeProcess:
    """What the supervisor reads of a ``Popen``: pid, poll, kill, wait."""

    pids = itertools.count(1000)

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


class FakeSystem:
    """A launcher whose children are fake processes; each spawn gets fresh ports unless given some."""

    def __init__(self, tmp_path: Path, monkeypatch, **cfg) -> None:
        self.launcher = Launcher(LaunchConfig(Path("m"), state_file=tmp_path / "state.json", **cfg))
        self.spawned: list[tuple[str, dict[str, int]]] = []
        self.ports = itertools.count(50000)
        self.now = 0.0
        self.stop = threading.Event()
        self.out = io.StringIO()
        monkeypatch.setattr(self.launcher, "_spawn", self.spawn)
        monkeypatch.setattr(
            self.launcher, "wait_ready", lambda children: [self.ready(c) for c in children]
        )
        self.launcher.start_all()
        self.supervisor = Supervisor(self.launcher, self.stop, clock=lambda: self.now, out=self.out)

    def spawn(self, spec: ChildSpec, ports) -> Child:
        self.spawned.append((spec.name, dict(ports)))
        return Child(spec, FakeProcess(), dict(ports))

    def ready(self, child: Child) -> None:
        """The child prints READY with the ports it was given (fresh ones for 0)."""
        child.ready = {key: str(port or next(self.ports)) for key, port in child.ports.items()}

    def child(self, name: str) -> Child:
        return next(c for c in self.launcher.children if c.name == name)

    def poll_at(self, now: float) -> list[str]:
        """Poll at time ``now``; the lines the supervisor printed."""
        self.now = now
        before = self.out.tell()
        self.supervisor.poll()
        self.out.seek(before)
        lines = self.out.read().splitlines()
        self.out.seek(0, io.SEEK_END)
        return lines


def test_an_exited_child_is_restarted_on_its_ports_and_the_state_file_follows(
    tmp_path, monkeypatch
):
    system = FakeSystem(tmp_path, monkeypatch)
    old = system.child("decode")
    first_ports = old.bound_ports()
    assert system.poll_at(1.0) == []
    old.process.returncode = -9
    assert system.poll_at(2.0) == ["decode exited with code -9; restarting in 0.5 s (restart 1)"]
    assert system.poll_at(2.4) == [] and system.child("decode") is old
    num_spawned = len(system.spawned)
    assert system.poll_at(2.5) == []
    new = system.child("decode")
    assert new is not old and system.spawned[num_spawned:] == [("decode", first_ports)]
    assert system.poll_at(3.0) == []  # not ready yet
    system.ready(new)
    assert system.poll_at(3.5) == [f"decode is ready again (pid {new.process.pid})"]
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["decode"] == {
        "pid": new.process.pid,
        **{k: str(v) for k, v in first_ports.items()},
    }
    assert len(system.launcher.children) == 5  # replaced in place, so stop order is unchanged


def test_the_router_is_restarted_on_its_http_port_too(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, http_port=8123)
    router = system.child("router")
    assert router.bound_ports()["http_port"] == 8123
    router.process.returncode = 0
    system.poll_at(1.0)
    system.poll_at(1.5)
    assert system.spawned[-1] == ("router", router.bound_ports())


def test_the_delay_doubles_to_the_cap_and_resets_after_a_stable_run(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, restart=RestartPolicy(0.5, 4.0, stable_s=30.0))
    first_ports = system.child("prefill").bound_ports()
    system.child("prefill").process.returncode = 1
    delays, now = [], 0.0
    for _ in range(5):  # every restart exits before it is ready
        (line,) = system.poll_at(now)
        delays.append(line.split("restarting in ")[1])
        now += float(delays[-1].split()[0])
        assert system.poll_at(now) == []  # restarted
        system.child("prefill").process.returncode = 2
        now += 0.1
    assert delays == [
        "0.5 s (restart 1)",
        "1.0 s (restart 2)",
        "2.0 s (restart 3)",
        "4.0 s (restart 4)",
        "4.0 s (restart 5)",
    ]
    assert "exited with code 2 before it was ready" in system.out.getvalue()
    # a restart that never got ready is retried on the ports the first process bound
    assert [p for n, p in system.spawned if n == "prefill"][1:] == [first_ports] * 5
    system.child("prefill").process.returncode = None
    system.ready(system.child("prefill"))
    assert system.poll_at(now) == [
        f"prefill is ready again (pid {system.child('prefill').process.pid})"
    ]
    system.child("prefill").process.returncode = -9
    assert system.poll_at(now + 10) == [
        "prefill exited with code -9; restarting in 4.0 s (restart 6)"
    ]
    system.poll_at(now + 14)
    system.ready(system.child("prefill"))
    system.poll_at(now + 15)
    system.child("prefill").process.returncode = -9
    assert system.poll_at(now + 45.0) == [
        "prefill exited with code -9; restarting in 0.5 s (restart 7)"
    ]


def test_a_restart_that_misses_the_ready_timeout_is_killed_and_retried(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, ready_timeout_s=5.0)
    system.child("tokenizer").process.returncode = -9
    system.poll_at(0.0)
    system.poll_at(0.5)
    stuck = system.child("tokenizer")
    assert system.poll_at(5.5) == []
    assert system.poll_at(5.6) == [
        "tokenizer was not ready after 5 s (killed); restarting in 1.0 s (restart 2)"
    ]
    assert stuck.process.returncode == -9
    system.poll_at(6.6)
    assert system.child("tokenizer") is not stuck


def test_nothing_is_restarted_once_stopping(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch)
    decode = system.child("decode")
    decode.process.returncode = -9
    system.poll_at(0.0)
    system.stop.set()
    num_spawned = len(system.spawned)
    assert system.poll_at(10.0) == [] and system.child("decode") is decode
    system.child("prefill").process.returncode = -15
    assert system.poll_at(11.0) == [] and len(system.spawned) == num_spawned


def test_a_restart_gets_the_same_command_ports_and_environment(tmp_path, monkeypatch):
    popens: list[dict] = []

    class RecordingPopen:
        def __init__(self, cmd, **kwargs) -> None:
            popens.append({"cmd": cmd, **kwargs})
            self.pid, self.returncode = 7, None
            self.stdout = io.StringIO("loading\nREADY decode port=41000 metrics_port=41001\n")

    monkeypatch.setattr(launcher_module.subprocess, "Popen", RecordingPopen)
    launcher = Launcher(LaunchConfig(Path("m"), log_dir=tmp_path / "logs"))
    first = launcher.start(ChildSpec("decode", ("--num-pages", "8")))
    launcher.wait_ready([first])
    second = launcher.restart(first)
    launcher.wait_ready([second])
    assert launcher.children == [second]
    cmds = [p["cmd"] for p in popens]
    tails = [cmd[cmd.index("--port") :] for cmd in cmds]
    assert tails[0] == ["--port", "0", "--metrics-port", "0", "--num-pages", "8"]
    assert tails[1] == ["--port", "41000", "--metrics-port", "41001", "--num-pages", "8"]
    assert cmds[0][: cmds[0].index("--port")] == cmds[1][: cmds[1].index("--port")]
    assert popens[0]["env"] is popens[1]["env"] is launcher.env
    assert all(
        p["stderr"].closed for p in popens
    )  # the launcher keeps no log file open per restart


# ------------------------------------------------------------------ observability


def started_ports(cfg: LaunchConfig, monkeypatch) -> dict[str, dict[str, int]]:
    """The ports ``start_all`` gives each service, without starting any process."""
    ports: dict[str, dict[str, int]] = {}

    def start(spec: ChildSpec) -> SimpleNamespace:
        ports[spec.name] = dict(spec.ports)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "2"}, address="127.0.0.1:1"
        )

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    return ports


def test_metrics_port_base_gives_each_service_a_fixed_metrics_port(monkeypatch) -> None:
    ports = started_ports(LaunchConfig(Path("m"), metrics_port_base=9100), monkeypatch)
    assert {name: p["metrics_port"] for name, p in ports.items()} == {
        "tokenizer": 9100,
        "vision_encoder": 9101,
        "decode": 9103,
        "prefill": 9102,
        "router": 9104,
    }
    assert all(p["port"] == 0 for p in ports.values()) and ports["router"]["http_port"] == 8000
    defaults = started_ports(LaunchConfig(Path("m")), monkeypatch)
    assert all(p["metrics_port"] == 0 for p in defaults.values())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics-port-base", "65533"], "--metrics-port-base must be in [1, 65531], got 65533"),
        (["--metrics-port-base", "0"], "--metrics-port-base must be in [1, 65531], got 0"),
        (["--port", "9102", "--metrics-port-base", "9100"], "include the HTTP port 9102"),
    ],
)
def test_up_checks_the_metrics_port_base(argv, message, capsys) -> None:
    assert main(["up", "--port", "0", "--transfer-backend", "shm", *argv]) == 2
    assert message in capsys.readouterr().err


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


def test_encoder_ranks_reach_the_vision_encoder_only_when_given(monkeypatch, capsys) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", "--encoder-ranks", "2"]) == 0
    assert configs[0].encoder_ranks == 2
    args = service_args(configs[0], monkeypatch)
    assert args["vision_encoder"] == ["--transfer-backend", "shm", "--ranks", "2"]
    # decode: its DP ranks; prefill: its CP ranks
    assert [n for n, a in args.items() if "--ranks" in a] == ["vision_encoder", "decode", "prefill"]
    assert args["prefill"][args["prefill"].index("--ranks") + 1] == "1"
    assert "--ranks" not in service_args(LaunchConfig(Path("m")), monkeypatch)["vision_encoder"]
    assert main(["up", "--port", "0", "--encoder-ranks", "0"]) == 2
    assert "--encoder-ranks must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------ DP decode and router workers


def test_decode_dp_and_router_workers_reach_their_processes(monkeypatch) -> None:
    specs: list[ChildSpec] = []

    def start(spec: ChildSpec) -> SimpleNamespace:
        specs.append(spec)
        return SimpleNamespace(
            name=spec.name, ready={"port": "1", "http_port": "8123"}, address="127.0.0.1:1"
        )

    launcher = Launcher(LaunchConfig(Path("m"), decode_dp=3, router_workers=3, http_port=0))
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children: None)
    launcher.start_all()
    by_name = {spec.name: spec for spec in specs}
    decode = list(by_name["decode"].args)
    assert decode[decode.index("--ranks") + 1] == "3"
    routers = [spec for spec in specs if spec.module == "services.router"]
    assert [spec.name for spec in routers] == ["router", "router-2", "router-3"]
    assert all("--http-reuse-port" in spec.args for spec in routers)
    assert [spec.ports["http_port"] for spec in routers] == [
        0,
        8123,
        8123,
    ]  # the first one's port, shared
    assert routers[1].args == routers[0].args
    single = service_args(LaunchConfig(Path("m")), monkeypatch)
    assert (
        "--http-reuse-port" not in single["router"]
        and single["decode"][single["decode"].index("--ranks") + 1] == "1"
    )


def test_router_workers_default_to_the_machine_size() -> None:
    assert [launcher_module.default_router_workers(n) for n in (1, 2, 8, 16, 31, 64, 256)] == [
        1,
        1,
        1,
        2,
        3,
        4,
        4,
    ]


def test_up_takes_decode_dp_and_router_workers(monkeypatch, capsys) -> None:
    configs: list[LaunchConfig] = []
    monkeypatch.setattr(launcher_module, "run_up", lambda cfg, env=None: configs.append(cfg) or 0)
    assert main(["up", "--port", "0", "--decode-dp", "2", "--router-workers", "3"]) == 0
    assert main(["up", "--port", "0"]) == 0
    (given, default) = configs
    assert (given.decode_dp, given.router_workers) == (2, 3)
    assert (default.decode_dp, default.router_workers) == (
        1,
        launcher_module.default_router_workers(),
    )
    for flag in ("--decode-dp", "--router-workers"):
        with pytest.raises(SystemExit) as exc:
            main(["up", flag, "0"])
        assert exc.value.code == 2
        assert f"argument {flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_a_decode_device_list_puts_one_rank_on_each(monkeypatch, capsys) -> None:
    cfg = LaunchConfig(Path("m"), device="cuda:0", decode_device="cuda:0,cuda:1")
    args = service_args(cfg, monkeypatch)
    assert args["decode"][args["decode"].index("--devices") + 1] == "cuda:0,cuda:1"
    assert "--ranks" not in args["decode"]
    flags = common_args(cfg, "decode")
    assert flags[flags.index("--device") + 1] == "cuda:0"
    assert (
        main(
            [
                "up",
                "--device",
                "cuda:0",
                "--decode-device",
                "cuda:0,cuda:1",
                "--decode-dp",
                "3",
                "--kv-transfer-backend",
                "cuda_ipc",
            ]
        )
        == 2
    )
    assert "--decode-dp 3 disagrees with --decode-device (2 devices)" in capsys.readouterr().err
    assert (
        main(
            [
                "up",
                "--device",
                "cuda:0",
                "--decode-device",
                "cuda:1,cpu",
                "--kv-transfer-backend",
                "cuda_ipc",
            ]
        )
        == 2
    )  # every rank's device is checked against the KV backend
    assert "needs a CUDA device" in capsys.readouterr().err
