"""``stageserve up``'s supervisor: an exited service, or one that answers no liveness check,
is restarted on its ports, after a growing delay, with the same command and environment."""

from __future__ import annotations

import concurrent.futures
import io
import itertools
import json
import threading
from pathlib import Path

from services import launch_child
from services.common.restarts import RestartPolicy
from services.launch_child import Child
from services.launch_config import LaunchConfig, LivenessPolicy
from services.launch_spec import ChildSpec
from services.launcher import Launcher
from services.supervisor import ChildSupervisor


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


class FakeExecutor(concurrent.futures.Executor):
    """Runs each liveness check at once, or (``hold``) leaves it in flight."""

    def __init__(self) -> None:
        self.hold = False

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.hold:
            future.set_result(fn(*args, **kwargs))
        return future


class FakeSystem:
    """A launcher whose children are fake processes; each spawn gets fresh ports unless given
    some. Liveness checks answer unless the child's name is in ``silent``."""

    def __init__(self, tmp_path: Path, monkeypatch, **cfg) -> None:
        self.launcher = Launcher(LaunchConfig(Path("m"), state_file=tmp_path / "state.json", **cfg))
        self.spawned: list[tuple[str, dict[str, int]]] = []
        self.ports = itertools.count(50000)
        self.now = 0.0
        self.stop = threading.Event()
        self.out = io.StringIO()
        self.silent: set[str] = set()
        self.checks: list[tuple[str, float, float]] = []  # (child, when, deadline)
        self.executor = FakeExecutor()
        monkeypatch.setattr(self.launcher, "_spawn", self.spawn)
        monkeypatch.setattr(
            self.launcher,
            "wait_ready",
            lambda children, listening=False: [self.ready(c) for c in children],
        )
        self.launcher.start_all()
        self.supervisor = ChildSupervisor(
            self.launcher,
            self.stop,
            clock=lambda: self.now,
            out=self.out,
            probe=self.probe,
            executor=self.executor,
        )

    def probe(self, address: str, deadline_s: float) -> bool:
        (child,) = [c for c in self.launcher.children if c.ready and c.address == address]
        self.checks.append((child.name, self.now, deadline_s))
        return child.name not in self.silent

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

    monkeypatch.setattr(launch_child.subprocess, "Popen", RecordingPopen)
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


def test_a_child_that_answers_no_liveness_check_is_killed_and_restarted(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, liveness=LivenessPolicy(timeout_s=4.0))
    old = system.child("router")
    first_ports = old.bound_ports()
    assert system.poll_at(0.0) == []
    assert {name for name, _, _ in system.checks} == {c.name for c in system.launcher.children}
    assert {deadline_mono for _, _, deadline_mono in system.checks} == {
        1.0
    }  # interval: timeout / 4
    system.silent.add("router")
    for now in (0.5, 1.0, 2.0, 3.0, 3.9):  # the check sent at 0.0 answered
        assert system.poll_at(now) == []
    assert old.process.returncode is None
    assert system.poll_at(4.0) == [
        f"router (pid {old.process.pid}) answered no liveness check for 4.0 s (killed); "
        "restarting in 0.5 s (restart 1)"
    ]
    assert old.process.returncode == -9
    checks_of_router = [when for name, when, _ in system.checks if name == "router"]
    assert checks_of_router == [0.0, 1.0, 2.0, 3.0]  # one per interval, none piled up
    system.poll_at(4.5)
    new = system.child("router")
    assert new is not old and system.spawned[-1] == ("router", first_ports)
    system.silent.clear()
    system.ready(new)
    assert system.poll_at(5.0) == [f"router is ready again (pid {new.process.pid})"]
    assert all(system.poll_at(5.0 + i) == [] for i in range(20))
    assert new.process.returncode is None


def test_one_answer_within_the_bound_keeps_a_child(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, liveness=LivenessPolicy(timeout_s=4.0))
    system.silent.add("tokenizer")
    for now in range(3):
        assert system.poll_at(float(now)) == []
    system.silent.clear()  # the check sent at 3.0 answers
    assert all(system.poll_at(now) == [] for now in (3.0, 4.0, 5.0))
    system.silent.add("tokenizer")
    assert all(system.poll_at(now) == [] for now in (6.0, 7.0, 8.0))
    (line,) = system.poll_at(9.0)  # the last answered check went out at 5.0
    assert line.startswith("tokenizer (pid") and "for 4.0 s (killed)" in line


def test_a_check_in_flight_past_its_deadline_is_a_miss(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, liveness=LivenessPolicy(timeout_s=4.0))
    system.poll_at(0.0)
    system.executor.hold = True  # every check from now on hangs
    killed = []
    for step in range(1, 31):
        killed += system.poll_at(step * 0.2)
    assert sorted(line.split()[0] for line in killed) == sorted(
        c.name for c in system.launcher.children
    )
    assert all("answered no liveness check for 4.0 s (killed)" in line for line in killed)


def test_no_child_is_killed_for_silence_once_stopping(tmp_path, monkeypatch):
    system = FakeSystem(tmp_path, monkeypatch, liveness=LivenessPolicy(timeout_s=4.0))
    system.silent.add("decode")
    system.poll_at(0.0)
    system.stop.set()
    assert system.poll_at(20.0) == [] and system.child("decode").process.returncode is None
