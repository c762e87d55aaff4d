"""Start and stop the whole system (``stageserve up``) for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.system_load import up_command, up_http_port
from tests.conftest import REPO

if TYPE_CHECKING:  # the GPU machine's tests use this module without the openai client
    import openai

READY_TIMEOUT_S = 300


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@dataclass
class System:
    process: subprocess.Popen
    http_port: int
    workdir: Path
    state: dict = field(default_factory=dict)
    output: list[str] = field(default_factory=list)
    output_mono: list[float] = field(default_factory=list)  # when each output line arrived
    seen_pids: set[int] = field(default_factory=set)  # every child pid any state file named

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.state[service]['port']}"

    def metrics_url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.state[service]['metrics_port']}/metrics"

    def child_pids(self) -> list[int]:
        """Every child pid seen, restarted ones included."""
        return sorted(self.seen_pids)

    def reload_state(self) -> dict:
        """Read the state file again (the launcher rewrites it after a restart)."""
        self.state = json.loads((self.workdir / "state.json").read_text())
        self.seen_pids.update(v["pid"] for k, v in self.state.items() if k != "launcher")
        return self.state

    def health(self) -> int:
        """The router's ``/health`` status code (0: no answer)."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/health", timeout=5
            ) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def metric(self, service: str, name: str) -> float:
        """The sum of a Prometheus metric's samples on ``service``'s metrics port."""
        with urllib.request.urlopen(self.metrics_url(service), timeout=10) as reply:
            text = reply.read().decode()
        samples = re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        return sum(float(m.group(1)) for m in samples)

    def wait_for_output(
        self, text: str, start: int = 0, timeout_s: float = READY_TIMEOUT_S
    ) -> tuple[str, float]:
        """The first launcher output line from index ``start`` on that contains ``text``, and
        when it arrived (``time.monotonic()``)."""
        deadline_mono = time.monotonic() + timeout_s
        while time.monotonic() < deadline_mono:
            for index in range(start, len(self.output_mono)):
                if text in self.output[index]:
                    return self.output[index], self.output_mono[index]
            time.sleep(0.1)
        output = "\n".join(self.output)
        raise AssertionError(f"no launcher line with {text!r} in {timeout_s:.0f} s:\n{output}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}"
            for p in sorted((self.workdir / "logs").glob("*.log"))
        )

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)


def start_system(workdir: Path, *extra_args: str, env: dict[str, str] | None = None) -> System:
    """``stageserve up`` in ``workdir``; ``env``: the launcher's environment (default: this
    process's)."""
    cmd = up_command(0, workdir, extra_args)  # the router binds a free port; up prints it
    process = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    system = System(process, 0, workdir)
    up = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            system.output.append(line.rstrip())
            system.output_mono.append(time.monotonic())  # after the line: a reader sees both
            http_port = up_http_port(line)
            if http_port is not None:
                system.http_port = http_port
                up.set()

    threading.Thread(target=read, daemon=True).start()
    deadline_mono = time.monotonic() + READY_TIMEOUT_S
    while not up.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline_mono:
            system.stop()
            raise RuntimeError(
                "system did not come up:\n" + "\n".join(system.output) + "\n" + system.logs()
            )
    system.reload_state()
    return system


@contextlib.contextmanager
def running_system(
    workdir: Path, *extra_args: str, env: dict[str, str] | None = None
) -> Iterator[System]:
    """``start_system`` for a fixture: once its tests are done, the launcher stops with code 0
    and leaves no child alive (it is stopped, unchecked, when the block raises)."""
    system = start_system(workdir, *extra_args, env=env)
    try:
        yield system
    finally:
        code = system.stop()
    assert code == 0, system.logs()
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]


def openai_client(system: System, timeout_s: float = 120) -> openai.OpenAI:
    """The official client on ``system``'s router; no retries, so a test sees every error."""
    import openai

    return openai.OpenAI(
        base_url=system.base_url, api_key="unused", max_retries=0, timeout=timeout_s
    )


def endless_stream(
    client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int
) -> openai.Stream:
    """A greedy chat stream that ignores EOS: it runs for ``max_tokens`` unless cut short."""
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
