"""``stageserve up``: every service as its own OS process on one machine.

Start order follows the dependencies: tokenizer, vision encoder and decode first
(in parallel), then prefill (needs the encoder), then the router (needs everyone).
Each child binds port 0 and reports ``READY <name> port=... metrics_port=...`` on
stdout; the launcher waits for that line (bounded), then passes the addresses on.

Children die with the launcher: they are asked for SIGTERM on the launcher's death
(``PR_SET_PDEATHSIG``), and on Ctrl-C / SIGTERM the launcher stops them in reverse
order (SIGTERM, grace, then SIGKILL), so no process outlives it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.auth import child_environment
from services.common.errors import UnavailableError

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LaunchConfig:
    model: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 0
    device: str = "cpu"
    # per-service devices (default ``device``): e.g. prefill on cuda:0 and decode on cuda:1
    encoder_device: str | None = None
    prefill_device: str | None = None
    decode_device: str | None = None
    dtype: str | None = None
    transfer_backend: str = "mooncake"
    kv_transfer_backend: str | None = None  # prefill and decode's KV handoff; None: transfer_backend
    attention_backend: str = "torch"
    num_pages: int = 16384
    page_size: int = 16
    ready_timeout_s: float = 300.0
    stop_grace_s: float = 10.0
    log_dir: Path | None = None
    state_file: Path | None = None


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    ready: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    is_exit_reported: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ready['port']}"


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def device_of(cfg: LaunchConfig, name: str) -> str:
    """The device service ``name`` runs its model on (tokenizer and router run none)."""
    override = {"vision_encoder": cfg.encoder_device, "prefill": cfg.prefill_device, "decode": cfg.decode_device}
    return override.get(name) or cfg.device


def common_args(cfg: LaunchConfig, name: str) -> list[str]:
    args = ["--model", str(cfg.model), "--host", cfg.host, "--port", "0", "--metrics-port", "0",
            "--device", device_of(cfg, name)]
    return args + (["--dtype", cfg.dtype] if cfg.dtype else [])


class Launcher:
    def __init__(self, cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        # Children's environment (ours + a new internal token by default): secrets go here, not argv.
        self.env = dict(env) if env is not None else child_environment(os.environ)
        self.children: list[Child] = []

    def start(self, name: str, extra_args: list[str]) -> Child:
        cmd = [sys.executable, "-m", f"services.{name}", *common_args(self.cfg, name), *extra_args]
        stderr = subprocess.DEVNULL
        if self.cfg.log_dir is not None:
            self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
            stderr = open(self.cfg.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (owned by the child)
        process = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
            text=True, preexec_fn=_die_with_parent, env=self.env,
        )
        child = Child(name, process)
        self.children.append(child)
        threading.Thread(target=self._read_stdout, args=(child,), daemon=True, name=f"stdout-{name}").start()
        return child

    @staticmethod
    def _read_stdout(child: Child) -> None:
        assert child.process.stdout is not None
        for line in child.process.stdout:
            child.lines.append(line.rstrip())
            words = line.split()
            if len(words) >= 2 and words[0] == "READY" and words[1] == child.name and not child.ready:
                child.ready = dict(w.split("=", 1) for w in words[2:] if "=" in w)

    def wait_ready(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while not all(c.ready for c in children):
            for c in children:
                if not c.ready and c.process.poll() is not None:
                    raise UnavailableError(f"{c.name} exited with code {c.process.returncode} before it was ready")
            if time.monotonic() > deadline:
                late = [c.name for c in children if not c.ready]
                raise UnavailableError(f"not ready after {self.cfg.ready_timeout_s:.0f} s: {', '.join(late)}")
            time.sleep(0.05)

    def start_all(self) -> Child:
        cfg = self.cfg
        transfer = ["--transfer-backend", cfg.transfer_backend]
        kv = [] if cfg.kv_transfer_backend is None else ["--kv-transfer-backend", cfg.kv_transfer_backend]
        tokenizer = self.start("tokenizer", [])
        encoder = self.start("vision_encoder", transfer)
        decode = self.start("decode", [
            *transfer, *kv, "--num-pages", str(cfg.num_pages), "--page-size", str(cfg.page_size),
            "--attention-backend", cfg.attention_backend,
        ])
        self.wait_ready([tokenizer, encoder, decode])
        pages = ["--page-size", str(cfg.page_size), "--attention-backend", cfg.attention_backend]
        prefill = self.start("prefill", [*transfer, *kv, *pages, "--encoder-address", encoder.address])
        self.wait_ready([prefill])
        router = self.start("router", [
            "--http-host", cfg.host, "--http-port", str(cfg.http_port),
            "--tokenizer-address", tokenizer.address, "--prefill-address", prefill.address,
            "--decode-address", decode.address, "--encoder-address", encoder.address,
        ])
        self.wait_ready([router])
        self.write_state()
        return router

    def write_state(self) -> None:
        if self.cfg.state_file is None:
            return
        state = {c.name: {"pid": c.process.pid, **c.ready} for c in self.children}
        state["launcher"] = {"pid": os.getpid(), "config": json.loads(json.dumps(asdict(self.cfg), default=str))}
        self.cfg.state_file.write_text(json.dumps(state, indent=2))

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
                c.process.kill()
                c.process.wait()


def run_up(cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> int:
    launcher = Launcher(cfg, env)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        router = launcher.start_all()
        print(f"stageserve is up: OpenAI API at http://{cfg.host}:{router.ready.get('http_port')}/v1", flush=True)
        for c in launcher.children:
            print(f"  {c.name:<15} pid={c.process.pid} " + " ".join(f"{k}={v}" for k, v in c.ready.items()), flush=True)
        while not stop.wait(0.5):
            for c in launcher.children:
                if c.process.poll() is not None and not c.is_exit_reported:
                    print(f"{c.name} exited with code {c.process.returncode}", file=sys.stderr, flush=True)
                    c.is_exit_reported = True
        return 0
    except UnavailableError as exc:
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        return 1
    finally:
        launcher.stop_all()
