"""``stageserve up`` explains itself: a bad model, a taken port or a bad flag names the cause at
once; a child failing for a reason only it can tell prints the cause from its log; Ctrl-C while
starting
stops cleanly; `serve --help` and `bench --help` work."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import main
from services.launch_child import failure_lines
from tests.conftest import REPO

BOUND_S = 120  # "at once" is seconds; this only bounds a hang


def run_up(*args: str, timeout_s: float = BOUND_S) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_a_wrong_model_path_is_named_before_anything_starts(capsys) -> None:
    assert main(["up", "--model", "/nonexistent/model", "--port", "0"]) == 2
    assert "no config.json in model directory /nonexistent/model" in capsys.readouterr().err


def test_a_taken_http_port_is_named_before_anything_starts(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--port", str(port)]) == 2
    assert (
        f"cannot bind the HTTP port 127.0.0.1:{port}: Address already in use"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--num-pages", "0", "must be >= 1"),
        ("--port", "70000", "must be a port in [0, 65535]"),
        ("--stall-timeout-s", "0", "must be > 0"),
        ("--queue-timeout-s", "-1", "must be >= 0"),
    ],
)
def test_an_out_of_range_flag_is_refused_by_name(capsys, flag, value, rule) -> None:
    with pytest.raises(SystemExit) as info:
        main(["up", flag, value])
    assert info.value.code == 2
    assert f"argument {flag}: {rule}" in capsys.readouterr().err


def test_the_cause_is_taken_from_the_first_error_not_the_shutdown_noise(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    log.write_text(
        "2026-12-01 INFO services.decode: loading\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "ValueError: unsupported dtype 'float7'\n"
        "Exception ignored in: <function Server.__del__>\nTraceback (most recent call last):\n"
        '  File "y.py", line 2\nRuntimeError: Event loop is closed\n'
    )
    assert failure_lines(log)[0] == "ValueError: unsupported dtype 'float7'"
    quiet = tmp_path / "quiet.log"
    quiet.write_text("".join(f"line {i}\n" for i in range(40)))
    assert failure_lines(quiet, 3) == ["line 37", "line 38", "line 39"]  # no error line: the tail
    assert failure_lines(tmp_path / "missing.log") == []


@pytest.mark.e2e
@pytest.mark.slow
def test_a_child_that_fails_prints_the_cause_from_its_log(tmp_path: Path) -> None:
    code, output, elapsed_s = run_up("--dtype", "float7", "--port", "0", "--log-dir", str(tmp_path))
    assert code == 1, output
    assert "exited with code 1 before it was ready" in output
    assert "ValueError: unsupported dtype 'float7'; supported: float32, bfloat16, float16" in output
    assert "Event loop is closed" not in output  # the dying process's noise is not the cause
    print(f"cause printed after {elapsed_s:.1f} s")


@pytest.mark.e2e
@pytest.mark.slow
def test_ctrl_c_while_starting_stops_cleanly(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", "0", "--log-dir", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("stageserve up: devices: ")  # its choices
        assert process.stdout.readline().startswith("logs: ")  # started; the services are loading
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        output = process.communicate(timeout=BOUND_S)[0]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, output
    assert "interrupted while starting: stopping the services" in output
    assert "exited with code" not in output and "error:" not in output


@pytest.mark.parametrize("command", [["serve", "--help"], ["bench", "--help"], ["up", "--help"]])
def test_every_subcommand_has_help(capsys, command) -> None:
    with pytest.raises(SystemExit) as info:
        main(command)
    assert info.value.code == 0
    assert "usage: stageserve" in capsys.readouterr().out


def test_serve_passes_help_to_the_service(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "decode", "--help"])
    assert info.value.code == 0
    assert "--num-pages" in capsys.readouterr().out


def test_the_in_process_backend_is_refused_by_up(capsys) -> None:
    assert main(["up", "--port", "0", "--transfer-backend", "inprocess"]) == 2
    assert (
        "the inprocess transfer backend moves data within one process, and up runs every "
        "service as its own process: use one of mooncake, cuda_ipc, shm"
    ) in capsys.readouterr().err
