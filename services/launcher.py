"""``stageserve up``: every service as its own OS process on one machine, supervised.

Start order follows the dependencies: tokenizer, vision encoder and decode first
(in parallel), then prefill (needs the encoder), then the router (needs everyone).
Each child binds port 0 (its metrics port: ``metrics_port_base`` + its place in
``METRICS_PORT_ORDER`` when a base is given) and reports ``READY <name> port=...
metrics_port=...`` on stdout; the launcher waits for that line (bounded), then passes the
addresses on, and prints every service's ports once all are ready (``ready_table``).
A child that exits before it was ever ready fails start-up.

Once everything is up, the ``Supervisor`` restarts a child that exits (any code, any
signal) after a bounded exponential backoff, on the ports it had, so every address the
others hold stays valid (their channels reconnect by themselves), and rewrites the
state file when the new process is ready.

Children die with the launcher: they are asked for SIGTERM on the launcher's death
(``PR_SET_PDEATHSIG``), and on Ctrl-C / SIGTERM the launcher stops supervising, then
stops them in reverse order (SIGTERM, grace, then SIGKILL), so no process outlives it.
"""

from __future__ import annotations

import ctypes
import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from services.common.auth import child_environment
from services.common.errors import UnavailableError

_PR_SET_PDEATHSIG = 1
POLL_INTERVAL_S = 0.2
LOG_TAIL_LINES = 12  # of a failed child's log, printed on the console


class StartInterrupted(Exception):
    """Ctrl-C / SIGTERM arrived while the services were starting."""


def new_run_dir() -> Path:
    """A fresh directory for one ``up``'s logs: <tmp>/stageserve-<date>-<time>-<pid>."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / f"stageserve-{stamp}-{os.getpid()}"


def failure_lines(path: Path, num_lines: int = LOG_TAIL_LINES) -> list[str]:
    """Why a child failed, from its log: its error lines (ERROR log lines, argument errors) up to
    the exception of its first traceback, the last three of them; else the log's last ``num_lines``.

    What a failing process logs while it dies (its shutdown's own tracebacks) follows the cause
    and is left out.
    """
    try:
        lines = [
            line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.strip()
        ]
    except FileNotFoundError:
        return []
    causes: list[str] = []
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and not line[0].isspace():
            causes.append(line)
            break  # the first uncaught exception ends the story; later ones are its fallout
        elif " ERROR " in line or ": error:" in line:
            causes.append(line)
    if causes:
        return list(dict.fromkeys(causes))[-3:]
    return lines[-num_lines:]


# --metrics-port-base N: the service at index i serves /metrics on port N + i.
METRICS_PORT_ORDER = ("tokenizer", "vision_encoder", "prefill", "decode", "router")
MAX_PORT = 65535


@dataclass(frozen=True)
class RestartPolicy:
    """Delay before restarting a child: ``initial_backoff_s``, doubling per exit up to
    ``max_backoff_s``; a child that stayed up ``stable_s`` starts again from the initial delay."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    stable_s: float = 30.0


@dataclass(frozen=True)
class LaunchConfig:
    model: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    device: str = "cpu"
    # per-service devices (default ``device``): e.g. prefill on cuda:0 and decode on cuda:1
    encoder_device: str | None = None
    encoder_ranks: int | None = (
        None  # the vision encoder's rank processes (--ranks; None: its default, 1)
    )
    prefill_device: str | None = None
    decode_device: str | None = None
    dtype: str | None = None
    transfer_backend: str = "shm"
    kv_transfer_backend: str | None = (
        None  # prefill and decode's KV handoff; None: transfer_backend
    )
    attention_backend: str = "torch"
    num_pages: int = 16384  # per decode rank
    page_size: int = 16
    decode_dp: int = 1  # decode's data-parallel ranks (decode --ranks)
    router_workers: int = (
        1  # router processes sharing the HTTP port (default_router_workers() in the CLI)
    )
    # passed on only when set (None: the service's own default)
    stall_timeout_s: float | None = None  # router: per-hop progress bound
    max_concurrent_requests: int | None = None  # router: admission slots
    max_queued_requests: int | None = None  # router: admission queue
    queue_timeout_s: float | None = None  # router: wait limit in the admission queue
    served_model_name: str | None = None  # router
    max_model_len: int | None = None  # tokenizer, decode and router (--max-context-len)
    log_level: str | None = None  # every service
    kv_quarantine_s: float | None = None  # decode
    embedding_quarantine_s: float | None = None  # prefill
    prefill_cp: int = 1  # prefill's CP rank processes (its --ranks)
    prefill_cp_block_tokens: int | None = None  # prefill's --cp-block-tokens
    prefill_cp_min_tokens: int | None = None  # prefill's --cp-min-tokens
    ready_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    log_dir: Path | None = None
    log_format: str = "text"  # every service's --log-format: text | json
    metrics_port_base: int | None = None  # None: every service picks a free metrics port
    state_file: Path | None = None
    restart: RestartPolicy = field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        base = self.metrics_port_base
        if base is None:
            return
        last = base + len(METRICS_PORT_ORDER) - 1
        if not 1 <= base <= last <= MAX_PORT:
            highest = MAX_PORT - len(METRICS_PORT_ORDER) + 1
            raise ValueError(f"--metrics-port-base must be in [1, {highest}], got {base}")
        if base <= self.http_port <= last:
            raise ValueError(
                f"--metrics-port-base {base} gives the ports {base}-{last}, which include "
                f"the HTTP port {self.http_port}"
            )


def default_router_workers(num_cpus: int | None = None) -> int:
    """Router processes for this machine: one per 8 CPUs, at least 1, at most 4."""
    num_cpus = num_cpus if num_cpus is not None else os.cpu_count() or 1
    return max(1, min(4, num_cpus // 8))


@dataclass(frozen=True)
class ChildSpec:
    """How to start one service: its own flags, and the ports it binds.

    ``ports`` maps a READY-line key to its first value (0: any free port); a restart
    binds the ports the first process reported, each as ``--<key with dashes>``.
    ``service``: the package it runs (default ``name``; the second router is
    ``router-2``, running ``services.router``).
    """

    name: str
    args: tuple[str, ...] = ()
    ports: Mapping[str, int] = field(default_factory=lambda: {"port": 0, "metrics_port": 0})
    service: str = ""

    @property
    def module(self) -> str:
        return f"services.{self.service or self.name}"


@dataclass
class Child:
    """One process of a service; a restart makes a new ``Child`` with the same spec."""

    spec: ChildSpec
    process: subprocess.Popen
    ports: Mapping[str, int]  # what it was started with (0: any free port)
    ready: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def service(self) -> str:
        return self.spec.service or self.spec.name

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ready['port']}"

    def bound_ports(self) -> dict[str, int]:
        """The ports it binds: the ones it was given, else (0) the ones its READY line named."""
        return {key: port or int(self.ready[key]) for key, port in self.ports.items()}


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def device_of(cfg: LaunchConfig, name: str) -> str:
    """The device service ``name`` runs its model on (tokenizer and router run none)."""
    override = {
        "vision_encoder": cfg.encoder_device,
        "prefill": cfg.prefill_device,
        "decode": cfg.decode_device,
    }
    return override.get(name) or cfg.device


def decode_devices(cfg: LaunchConfig) -> tuple[str, ...]:
    """Decode's devices: a comma-separated --decode-device puts one DP rank on each."""
    return tuple(device for device in device_of(cfg, "decode").split(",") if device)


def common_args(cfg: LaunchConfig, name: str) -> list[str]:
    device = decode_devices(cfg)[0] if name == "decode" else device_of(cfg, name)
    args = ["--model", str(cfg.model), "--host", cfg.host, "--device", device]
    args += ["--log-format", cfg.log_format]
    return (
        args
        + (["--dtype", cfg.dtype] if cfg.dtype else [])
        + optional_arg("--log-level", cfg.log_level)
    )


def first_ports(cfg: LaunchConfig, name: str) -> dict[str, int]:
    """The ports service ``name`` starts on: any free gRPC port; its metrics port from
    ``metrics_port_base`` (0, any free one, without it)."""
    base = cfg.metrics_port_base
    return {"port": 0, "metrics_port": 0 if base is None else base + METRICS_PORT_ORDER.index(name)}


def port_args(ports: Mapping[str, int]) -> list[str]:
    return [arg for key, port in ports.items() for arg in (f"--{key.replace('_', '-')}", str(port))]


def optional_arg(flag: str, value: float | str | None) -> list[str]:
    return [] if value is None else [flag, str(value)]


class Launcher:
    """Starts, restarts and stops the children; ``children`` is in start order."""

    def __init__(
        self,
        cfg: LaunchConfig,
        env: Mapping[str, str] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.cfg = cfg
        # Children's environment (ours + a new internal token by default): secrets go here, not argv.
        # Built once: a restarted child must get what the first one got (the same token).
        self.env = dict(env) if env is not None else child_environment(os.environ)
        self.children: list[Child] = []
        self.stop = stop if stop is not None else threading.Event()  # set: start-up is abandoned

    def start(self, spec: ChildSpec) -> Child:
        child = self._spawn(spec, spec.ports)
        self.children.append(child)
        return child

    def restart(self, old: Child) -> Child:
        """Start ``old``'s service again on the ports ``old`` bound; it takes ``old``'s place."""
        child = self._spawn(old.spec, old.bound_ports())
        self.children[self.children.index(old)] = child
        return child

    def _spawn(self, spec: ChildSpec, ports: Mapping[str, int]) -> Child:
        # Called from the main thread only: PR_SET_PDEATHSIG fires when the forking thread ends.
        cmd = [
            sys.executable,
            "-m",
            spec.module,
            *common_args(self.cfg, spec.service or spec.name),
            *port_args(ports),
            *spec.args,
        ]
        stderr = subprocess.DEVNULL
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.cfg.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115 (closed below)
        try:
            process = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                text=True,
                env=self.env,
                preexec_fn=_die_with_parent,
            )
        finally:
            if stderr is not subprocess.DEVNULL:
                stderr.close()  # the child holds its own copy
        child = Child(spec, process, dict(ports))
        threading.Thread(
            target=self._read_stdout, args=(child,), daemon=True, name=f"stdout-{spec.name}"
        ).start()
        return child

    @staticmethod
    def _read_stdout(child: Child) -> None:
        assert child.process.stdout is not None
        for line in child.process.stdout:
            child.lines.append(line.rstrip())
            words = line.split()
            is_ready_line = len(words) >= 2 and words[0] == "READY" and words[1] == child.service
            if is_ready_line and not child.ready:
                child.ready = dict(w.split("=", 1) for w in words[2:] if "=" in w)

    def log_path(self, name: str) -> Path | None:
        return None if self.cfg.log_dir is None else self.cfg.log_dir / f"{name}.log"

    def log_hint(self, name: str) -> str:
        path = self.log_path(name)
        return "" if path is None else f" (log: {path})"

    def why(self, name: str) -> str:
        """The end of ``name``'s log, indented, for the console: the real cause of a failure."""
        path = self.log_path(name)
        lines = [] if path is None else failure_lines(path)
        return "".join(f"\n    {line}" for line in lines)

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not all(c.ready for c in children):
            if self.stop.is_set():  # checked first: a Ctrl-C also stops the children themselves
                raise StartInterrupted()
            for c in children:
                if not c.ready and c.process.poll() is not None:
                    raise UnavailableError(
                        f"{c.name} exited with code {c.process.returncode} before it was ready"
                        + self.log_hint(c.name)
                        + self.why(c.name)
                    )
            if time.monotonic() > deadline:
                late = [c.name for c in children if not c.ready]
                timeout_s = self.cfg.ready_timeout_s
                raise UnavailableError(f"not ready after {timeout_s:.0f} s: {', '.join(late)}")
            time.sleep(0.05)

    def start_all(self) -> Child:
        cfg = self.cfg
        transfer = ("--transfer-backend", cfg.transfer_backend)
        kv = optional_arg("--kv-transfer-backend", cfg.kv_transfer_backend)
        pages = ("--page-size", str(cfg.page_size), "--attention-backend", cfg.attention_backend)
        max_len = optional_arg("--max-model-len", cfg.max_model_len)
        tokenizer = self.start(
            ChildSpec("tokenizer", tuple(max_len), first_ports(cfg, "tokenizer"))
        )
        encoder_args = (*transfer, *optional_arg("--ranks", cfg.encoder_ranks))
        encoder = self.start(
            ChildSpec("vision_encoder", encoder_args, first_ports(cfg, "vision_encoder"))
        )
        decode = self.start(
            ChildSpec(
                "decode",
                (
                    *transfer,
                    *kv,
                    "--num-pages",
                    str(cfg.num_pages),
                    *pages,
                    *max_len,
                    *self.decode_rank_args(),
                    *optional_arg("--kv-quarantine-s", cfg.kv_quarantine_s),
                ),
                first_ports(cfg, "decode"),
            )
        )
        self.wait_ready([tokenizer, encoder, decode])
        prefill = self.start(
            ChildSpec(
                "prefill",
                (
                    *transfer,
                    *kv,
                    *pages,
                    "--encoder-address",
                    encoder.address,
                    *optional_arg("--embedding-quarantine-s", cfg.embedding_quarantine_s),
                    "--ranks",
                    str(cfg.prefill_cp),
                    *optional_arg("--cp-block-tokens", cfg.prefill_cp_block_tokens),
                    *optional_arg("--cp-min-tokens", cfg.prefill_cp_min_tokens),
                ),
                first_ports(cfg, "prefill"),
            )
        )
        self.wait_ready([prefill])
        router_args = (
            "--http-host",
            cfg.host,
            "--tokenizer-address",
            tokenizer.address,
            "--prefill-address",
            prefill.address,
            "--decode-address",
            decode.address,
            "--encoder-address",
            encoder.address,
            *optional_arg("--served-model-name", cfg.served_model_name),
            *optional_arg("--max-context-len", cfg.max_model_len),
            *optional_arg("--stall-timeout-s", cfg.stall_timeout_s),
            *optional_arg("--max-concurrent-requests", cfg.max_concurrent_requests),
            *optional_arg("--max-queued-requests", cfg.max_queued_requests),
            *optional_arg("--queue-timeout-s", cfg.queue_timeout_s),
            *(("--http-reuse-port",) if cfg.router_workers > 1 else ()),
        )
        router = self.start(
            ChildSpec(
                "router",
                router_args,
                {**first_ports(cfg, "router"), "http_port": cfg.http_port},
            )
        )
        self.wait_ready([router])
        http_port = int(router.ready["http_port"])  # the others share it (SO_REUSEPORT)
        others = [
            self.start(
                ChildSpec(
                    f"router-{i + 1}",
                    router_args,
                    {"port": 0, "metrics_port": 0, "http_port": http_port},
                    "router",
                )
            )
            for i in range(1, cfg.router_workers)
        ]
        self.wait_ready(others)
        self.write_state()
        return router

    def decode_rank_args(self) -> tuple[str, ...]:
        devices = decode_devices(self.cfg)
        if len(devices) > 1:
            return ("--devices", ",".join(devices))
        return ("--ranks", str(self.cfg.decode_dp))

    def write_state(self) -> None:
        """Pids and ports of the current children as JSON, replaced atomically (no reader sees
        half a file)."""
        if self.cfg.state_file is None:
            return
        state = {c.name: {"pid": c.process.pid, **c.ready} for c in self.children}
        config = json.loads(json.dumps(asdict(self.cfg), default=str))
        state["launcher"] = {"pid": os.getpid(), "config": config}
        partial = self.cfg.state_file.with_name(self.cfg.state_file.name + ".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.replace(self.cfg.state_file)

    @staticmethod
    def kill(child: Child) -> None:
        child.process.kill()
        child.process.wait()

    def stop_all(self) -> None:
        """SIGTERM every child (router first), wait ``stop_grace_s``, SIGKILL what is left."""
        for c in reversed(self.children):
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_grace_s
        for c in reversed(self.children):
            try:
                c.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(c)


class WatchState(enum.Enum):
    RUNNING = "running"  # ready; an exit schedules a restart
    WAITING = "waiting"  # exited; restarts at ``restart_at``
    STARTING = "starting"  # restarted; waiting for its READY line


@dataclass
class _Watch:
    backoff_s: float
    since: float  # when ``state`` was entered
    state: WatchState = WatchState.RUNNING
    restart_at: float = 0.0
    num_restarts: int = 0


class Supervisor:
    """Restarts the launcher's children when they exit after start-up.

    Call ``poll`` from the main thread (it spawns processes) until ``stop`` is set; no
    restart starts once it is. Lines go to ``out``: the exit and the delay, then
    ``<name> is ready again (pid N)``. A restart that exits or misses ``ready_timeout_s``
    before its READY line counts as another exit (the delay keeps growing).
    """

    def __init__(
        self,
        launcher: Launcher,
        stop: threading.Event,
        clock: Callable[[], float] = time.monotonic,
        out: TextIO | None = None,
    ) -> None:
        self._launcher = launcher
        self._policy = launcher.cfg.restart
        self._stop = stop
        self._clock = clock
        self._out = out
        now = clock()
        self._watches = {
            c.name: _Watch(self._policy.initial_backoff_s, now) for c in launcher.children
        }

    def _say(self, line: str) -> None:
        print(line, file=self._out if self._out is not None else sys.stderr, flush=True)

    def poll(self) -> None:
        for child in list(self._launcher.children):
            if self._stop.is_set():
                return
            self._step(child, self._watches[child.name], self._clock())

    def _step(self, child: Child, watch: _Watch, now: float) -> None:
        code = child.process.poll()
        if watch.state is WatchState.RUNNING:
            if code is not None:
                up_s = now - watch.since
                self._schedule(
                    child.name, watch, now, f"exited with code {code}", up_s=up_s, code=code
                )
        elif watch.state is WatchState.WAITING:
            if now >= watch.restart_at:
                self._launcher.restart(child)
                watch.state, watch.since = WatchState.STARTING, now
        elif child.ready:
            watch.state, watch.since = WatchState.RUNNING, now
            self._launcher.write_state()
            self._say(f"{child.name} is ready again (pid {child.process.pid})")
        elif code is not None:
            self._schedule(
                child.name, watch, now, f"exited with code {code} before it was ready", code=code
            )
        elif now - watch.since > self._launcher.cfg.ready_timeout_s:
            self._launcher.kill(child)
            timeout_s = self._launcher.cfg.ready_timeout_s
            self._schedule(
                child.name, watch, now, f"was not ready after {timeout_s:.0f} s (killed)"
            )

    def _schedule(
        self, name: str, watch: _Watch, now: float, what: str, up_s: float = 0.0, code: int = 0
    ) -> None:
        """``code`` > 0: the child exited by itself, so its log says why (printed after the line)."""
        if up_s >= self._policy.stable_s:
            watch.backoff_s = self._policy.initial_backoff_s
        delay_s = watch.backoff_s
        watch.backoff_s = min(delay_s * 2, self._policy.max_backoff_s)
        watch.num_restarts += 1
        watch.state, watch.restart_at, watch.since = WatchState.WAITING, now + delay_s, now
        why = self._launcher.log_hint(name) + self._launcher.why(name) if code > 0 else ""
        self._say(
            f"{name} {what}; restarting in {delay_s:.1f} s (restart {watch.num_restarts}){why}"
        )


def ready_table(host: str, children: list[Child]) -> list[str]:
    """The lines ``up`` prints once every service is ready: each one's pid, gRPC port and
    ``/metrics`` address (the router's also its HTTP port)."""
    lines = [f"  {'service':<15} {'pid':>8} {'grpc':>6}  metrics"]
    for c in children:
        http = f"  (HTTP port {c.ready['http_port']})" if "http_port" in c.ready else ""
        metrics = f"http://{host}:{c.ready.get('metrics_port', '?')}/metrics"
        grpc = c.ready.get("port", "?")
        lines.append(f"  {c.name:<15} {c.process.pid:>8} {grpc:>6}  {metrics}{http}")
    return lines


def run_up(cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> int:
    stop = threading.Event()
    launcher = Launcher(cfg, env, stop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if cfg.log_dir is not None:
        print(f"logs: {cfg.log_dir}", flush=True)
    try:
        router = launcher.start_all()
        http_port = router.ready.get("http_port")
        print(f"stageserve is up: OpenAI API at http://{cfg.host}:{http_port}/v1", flush=True)
        for line in ready_table(cfg.host, launcher.children):
            print(line, flush=True)
        supervisor = Supervisor(launcher, stop)
        while not stop.wait(POLL_INTERVAL_S):
            supervisor.poll()
        return 0
    except StartInterrupted:
        print("interrupted while starting: stopping the services", file=sys.stderr, flush=True)
        return 130
    except UnavailableError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_all()
