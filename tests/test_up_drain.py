"""``up``'s stop: the routers drain first (SIGTERM, then their whole drain budget), the workers
get SIGTERM only once the routers have exited, decode and prefill with their own drain's time;
a second Ctrl-C cuts the routers' drain short."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.decode.config import STOP_AFTER_DRAIN_S as DECODE_STOP_AFTER_DRAIN_S
from services.decode.config import DecodeConfig
from services.launch_child import Child
from services.launch_spec import (
    ChildSpec,
    LaunchConfig,
    decode_spec,
    prefill_spec,
    router_stop_s,
    worker_stop_s,
)
from services.launcher import Launcher
from services.prefill.config import STOP_AFTER_DRAIN_S as PREFILL_STOP_AFTER_DRAIN_S
from services.prefill.config import PrefillConfig
from services.router.config import STOP_AFTER_DRAIN_S

BOUND_S = 30.0
WORKER_STOP_AFTER_DRAIN_S = {
    "decode": DECODE_STOP_AFTER_DRAIN_S,
    "prefill": PREFILL_STOP_AFTER_DRAIN_S,
}
# A child that logs its SIGTERM, lingers (a router draining), logs its exit and exits 0.
CHILD = """
import pathlib, signal, sys, time
log, name, linger_s = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
def note(what):
    with log.open("a") as f:
        f.write(f"{name} {what}\\n")
def on_term(*_):
    note("term")
    time.sleep(linger_s)
    note("exit")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("up", flush=True)
while True:
    time.sleep(1)
"""


def start_child(log: Path, spec: ChildSpec, linger_s: float) -> Child:
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log), spec.name, str(linger_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "up\n"
    return Child(spec, process, {})


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    cfg = LaunchConfig(model=tmp_path, drain_timeout_s=BOUND_S, stop_grace_s=BOUND_S)
    launcher = Launcher(cfg, env={})
    yield launcher
    for child in launcher.children:
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait()


def events(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def wait_for(predicate, timeout_s: float = BOUND_S) -> None:
    deadline_mono = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline_mono, "timed out"
        time.sleep(0.02)


def test_the_drain_budget_of_up_is_the_routers(tmp_path: Path) -> None:
    cfg = LaunchConfig(model=tmp_path, drain_timeout_s=42.0)
    assert router_stop_s(cfg) == 42.0 + STOP_AFTER_DRAIN_S
    assert router_stop_s(LaunchConfig(model=tmp_path)) == 300.0 + STOP_AFTER_DRAIN_S


def test_workers_stop_only_after_the_routers_drained(launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "events.log"
    launcher.children = [
        start_child(log, ChildSpec("tokenizer"), 0.0),
        start_child(log, ChildSpec("decode"), 0.0),
        start_child(log, ChildSpec("router"), 1.0),
        start_child(log, ChildSpec("router-2", service="router"), 0.5),
    ]
    launcher.stop_all()
    seen = events(log)
    last_router_exit = max(seen.index("router exit"), seen.index("router-2 exit"))
    assert seen.index("tokenizer term") > last_router_exit, seen
    assert seen.index("decode term") > last_router_exit, seen
    assert [c.process.returncode for c in launcher.children] == [0, 0, 0, 0]


def test_a_second_signal_cuts_the_drain_short(launcher: Launcher, tmp_path: Path) -> None:
    log = tmp_path / "events.log"
    launcher.children = [
        start_child(log, ChildSpec("decode"), 0.0),
        start_child(log, ChildSpec("router"), 3600.0),
    ]
    stopping = threading.Thread(target=launcher.stop_all)
    stopping.start()
    wait_for(lambda: "router term" in events(log))
    assert "decode term" not in events(log)
    launcher.hurry.set()
    stopping.join(BOUND_S)
    assert not stopping.is_alive()
    decode, router = launcher.children
    assert router.process.returncode == -9
    assert decode.process.returncode == 0 and "decode term" in events(log)


def test_up_gives_decode_and_prefill_the_drain_budget_and_the_time_to_use_it(
    tmp_path: Path,
) -> None:
    cfg = LaunchConfig(model=tmp_path, drain_timeout_s=42.0)
    for service, spec in (("decode", decode_spec(cfg)), ("prefill", prefill_spec(cfg, "e:1"))):
        args = list(spec.args)
        assert args[args.index("--drain-timeout-s") + 1] == "42.0", service
        assert worker_stop_s(cfg, service) == 42.0 + WORKER_STOP_AFTER_DRAIN_S[service]
    defaults = LaunchConfig(model=tmp_path)
    assert "--drain-timeout-s" not in decode_spec(defaults).args  # decode's own default
    assert worker_stop_s(defaults, "decode") == DecodeConfig(model=tmp_path).stop_s
    assert worker_stop_s(defaults, "prefill") == PrefillConfig(model=tmp_path).stop_s
    assert worker_stop_s(cfg, "tokenizer") == cfg.stop_grace_s


def test_a_draining_worker_gets_its_stop_time_the_others_the_grace(tmp_path: Path) -> None:
    cfg = LaunchConfig(model=tmp_path, drain_timeout_s=BOUND_S, stop_grace_s=0.1)
    launcher = Launcher(cfg, env={})
    log = tmp_path / "events.log"
    try:
        launcher.children = [
            start_child(log, ChildSpec("decode"), 1.0),
            start_child(log, ChildSpec("tokenizer"), BOUND_S),
        ]
        launcher.stop_all()
        decode, tokenizer = launcher.children
        assert decode.process.returncode == 0 and "decode exit" in events(log)
        assert tokenizer.process.returncode == -9  # past its grace
    finally:
        for child in launcher.children:
            if child.process.poll() is None:
                child.process.kill()
            child.process.wait()
