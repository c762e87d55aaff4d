"""One child process of ``stageserve up`` and what it announces: ``LISTENING <service> port=...``
once its gRPC server is bound, ``READY <service> port=... metrics_port=...`` once it serves
(``services.common.service_main``); how it is started (``spawn_child``) and why it failed, from
its log (``failure_lines``)."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.launch_spec import ChildSpec

_PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 12  # of a failed child's log, printed on the console


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


@dataclass
class Child:
    """One process of a service; a restart makes a new ``Child`` with the same spec."""

    spec: ChildSpec
    process: subprocess.Popen
    ports: Mapping[str, int]  # what it was started with (0: any free port)
    ready: dict[str, str] = field(default_factory=dict)
    listening: dict[str, str] = field(default_factory=dict)  # its LISTENING line (before READY)
    lines: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def service(self) -> str:
        return self.spec.service or self.spec.name

    @property
    def address(self) -> str:
        return f"127.0.0.1:{(self.ready or self.listening)['port']}"

    def read_stdout(self) -> None:
        """Read the process's stdout to its end, keeping every line and its own service's first
        ``READY`` and ``LISTENING`` lines' fields."""
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip())
            words = line.split()
            if len(words) < 2 or words[1] != self.service:
                continue
            fields = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            if words[0] == "READY" and not self.ready:
                self.ready = fields
            elif words[0] == "LISTENING" and not self.listening:
                self.listening = fields

    def bound_ports(self) -> dict[str, int]:
        """The ports it binds: the ones it was given, else (0) the ones its READY line named."""
        return {key: port or int(self.ready[key]) for key, port in self.ports.items()}


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_child(
    spec: ChildSpec,
    ports: Mapping[str, int],
    cmd: list[str],
    env: Mapping[str, str],
    log_path: Path | None,
) -> Child:
    """Start ``cmd`` as ``spec``'s process on ``ports``: stderr to ``log_path`` (appended; none:
    discarded), stdout read by a thread of its own (``Child.read_stdout``), SIGTERM when the
    forking thread ends (call it from the main thread), in a process group of its own (a
    terminal's Ctrl-C goes to up alone, which drains first)."""
    stderr = subprocess.DEVNULL
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stderr = open(log_path, "ab")  # noqa: SIM115 (closed below)
    try:
        process = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,  # the launcher's one environment: a restart gets what the first got
            preexec_fn=_die_with_parent,
            process_group=0,
        )
    finally:
        if stderr is not subprocess.DEVNULL:
            stderr.close()  # the child holds its own copy
    child = Child(spec, process, dict(ports))
    threading.Thread(target=child.read_stdout, daemon=True, name=f"stdout-{spec.name}").start()
    return child
