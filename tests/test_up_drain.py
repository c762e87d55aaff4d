"""``up``'s stop: the routers drain first (SIGTERM, then their whole drain budget), the workers
get SIGTERM only once the routers have exited; a second Ctrl-C cuts the drain short."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launch_spec import ChildSpec, LaunchConfig, router_stop_s
from services.launcher import Child, Launcher
from services.router.config import STOP_AFTER_DRAIN_S

BOUND_S = 30.0
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
