"""``stageserve up --kv-store-gb``: the Mooncake store's master starts first and stops last,
prefill gets its address and the segment size, the supervisor restarts it on its ports, and
``up`` refuses what could not run before starting anything. The master's process
(``python -m services.prefill.kv_store_master``) and its ``mooncake_master`` child: loopback
only, and reaped on every exit (SIGTERM, the master's death, the process's SIGKILL, a failed
start). Through the whole system: ``tests/e2e/test_kv_store.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.cli import main
from services.common.errors import UnavailableError
from services.common.paths import BUNDLED_MODEL
from services.launch_child import Child
from services.launch_spec import ChildSpec, LaunchConfig, common_args, kv_store_spec, port_args
from services.launcher import Launcher
from services.prefill import kv_store_master
from services.supervisor import check_liveness
from tests.conftest import REPO
from tests.e2e.system import pid_alive
from tests.launch_fakes import assert_up_process_refuses, fail_if_started, recorded_configs
from tests.test_up_supervisor import FakeSystem


def _has_master() -> str | None:
    try:
        kv_store_master.master_binary()
    except FileNotFoundError as exc:
        return str(exc)
    return None


MASTER_MISSING = _has_master()
needs_master = pytest.mark.skipif(
    MASTER_MISSING is not None, reason=f"no mooncake_master: {MASTER_MISSING}"
)
STORE_ON = ["--kv-store-gb", "0.5", "--host", "0.0.0.0", "--api-key", "sk-up"]


def started(cfg: LaunchConfig, monkeypatch) -> tuple[list[ChildSpec], list[str]]:
    """The specs ``start_all`` starts, in order (no process; the master reports port 4567),
    and the children whose store it checked."""
    specs: list[ChildSpec] = []
    checked: list[str] = []

    def start(spec: ChildSpec) -> SimpleNamespace:
        specs.append(spec)
        ready = {"port": "1", "http_port": "2", "metrics_port": "3", "master_port": "4567"}
        return SimpleNamespace(name=spec.name, ready=ready, address="127.0.0.1:1")

    launcher = Launcher(cfg)
    monkeypatch.setattr(launcher, "start", start)
    monkeypatch.setattr(launcher, "wait_ready", lambda children, listening=False: None)
    monkeypatch.setattr(launcher, "check_store", lambda store: checked.append(store.name))
    launcher.start_all()
    return specs, checked


def prefill_of(cfg: LaunchConfig, specs: list[ChildSpec]):
    """Prefill's config from the whole argv ``up`` gives it, parsed as its ``__main__`` does."""
    from services.prefill.__main__ import parse_args

    (spec,) = [s for s in specs if s.name == "prefill"]
    return parse_args([*common_args(cfg, "prefill"), *port_args(spec.ports), *spec.args])


def test_the_master_starts_first_and_prefill_gets_its_address_and_segment(monkeypatch) -> None:
    cfg = LaunchConfig(BUNDLED_MODEL, kv_store_gb=0.5, prefill_cp=2)
    specs, checked = started(cfg, monkeypatch)
    assert [s.name for s in specs][:2] == ["kv_store_master", "tokenizer"]
    assert specs[0].module == "services.prefill.kv_store_master"
    assert specs[0].ports == {"port": 0, "metrics_port": 0, "master_port": 0}
    prefill = prefill_of(cfg, specs)
    assert prefill.kv_store_master == "127.0.0.1:4567"
    assert prefill.kv_store_segment_gb == 0.5 and len(prefill.devices) == 2  # 0.5 GB per rank
    assert checked == ["kv_store_master"]

    cfg = LaunchConfig(BUNDLED_MODEL)  # the default: no store
    specs, checked = started(cfg, monkeypatch)
    assert "kv_store_master" not in [s.name for s in specs] and checked == []
    assert prefill_of(cfg, specs).kv_store_master == ""
    assert not any("--kv-store" in arg for s in specs for arg in s.args)


def test_up_turns_the_store_on_with_one_warning_of_mooncakes_ports(monkeypatch, capsys) -> None:
    configs = recorded_configs(monkeypatch)
    assert main(["up", "--port", "0", *STORE_ON, "--transfer-backend", "mooncake"]) == 0
    assert configs[0].kv_store_gb == 0.5
    err = capsys.readouterr().err
    assert err.count("warning: Mooncake 0.3.13 listens on every interface") == 1
    assert main(["up", "--port", "0"]) == 0
    assert configs[1].kv_store_gb == 0 and "Mooncake" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--kv-store-gb", "0.5"], "error: --kv-store-gb cannot stay on --host 127.0.0.1: "),
        (
            [*STORE_ON, "--disable-prefix-cache"],
            "error: --kv-store-gb is the prefix cache's third tier: not with "
            "--disable-prefix-cache",
        ),
        (
            [*STORE_ON, "--prefill-tp", "2"],
            "error: --kv-store-gb with --prefill-tp 2: the store keeps whole pages",
        ),
        (
            [*STORE_ON, "--kv-store-gb", "0.001"],
            "error: --kv-store-gb must be 0 or at least 0.0167772 (Mooncake's smallest segment)",
        ),
    ],
)
def test_up_refuses_a_store_that_could_not_run(monkeypatch, capsys, argv, error) -> None:
    fail_if_started(monkeypatch)
    assert main(["up", "--port", "0", *argv]) == 2
    assert capsys.readouterr().err.startswith(error)


def test_up_takes_no_external_master(monkeypatch, capsys) -> None:
    """An external master is prefill's own ``--kv-store-master``; ``up`` starts its own."""
    fail_if_started(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["up", "--port", "0", *STORE_ON, "--kv-store-master", "10.0.0.2:50051"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --kv-store-master" in capsys.readouterr().err


def test_up_without_mooncake_master_refuses_and_names_the_install(tmp_path) -> None:
    # an importable ``mooncake`` without the binary shadows the real one; PATH has none either
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    (tmp_path / "bin").mkdir()
    env = {**os.environ, "PATH": str(tmp_path / "bin"), "PYTHONPATH": str(tmp_path)}
    assert_up_process_refuses(
        ["up", "--port", "0", *STORE_ON],
        env,
        tmp_path / "logs",
        "error: --kv-store-gb starts a mooncake_master, which is not installed (neither in the "
        "mooncake package nor on PATH): install stageserve's cpu or gpu extra (bash "
        "scripts/install.sh cpu, or gpu; it also installs libibverbs1 librdmacm1 libnuma1)",
    )


class SignalledProcess:
    """A process that exits on its first signal, noting its name in ``order``."""

    def __init__(self, name: str, order: list[str]) -> None:
        self.name, self.order, self.pid, self.returncode = name, order, 1, None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.order.append(self.name)
        self.returncode = 0

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


def test_the_master_is_stopped_after_every_worker() -> None:
    cfg = LaunchConfig(BUNDLED_MODEL, kv_store_gb=0.5)
    launcher = Launcher(cfg)
    order: list[str] = []
    store = kv_store_spec(cfg)
    assert store is not None
    for spec in (store, ChildSpec("tokenizer"), ChildSpec("prefill"), ChildSpec("router")):
        launcher.children.append(Child(spec, SignalledProcess(spec.name, order), {}))
    launcher.stop_all()
    assert order == ["router", "prefill", "tokenizer", "kv_store_master"]


def test_the_supervisor_restarts_the_master_on_its_three_ports(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(Launcher, "check_store", lambda self, store: None)
    system = FakeSystem(tmp_path, monkeypatch, kv_store_gb=0.5)
    old = system.child("kv_store_master")
    ports = old.bound_ports()
    assert set(ports) == {"port", "metrics_port", "master_port"} and all(ports.values())
    old.process.returncode = 1
    system.poll_at(1.0)
    system.poll_at(1.5)
    assert system.spawned[-1] == ("kv_store_master", ports)


# --- the master's process, with a real mooncake_master


class MasterProcess:
    """``python -m services.prefill.kv_store_master`` and its READY line's fields."""

    def __init__(self, log: Path, *args: str) -> None:
        cmd = [sys.executable, "-m", "services.prefill.kv_store_master", *args]
        with open(log, "ab") as stderr:
            self.process = subprocess.Popen(
                [*cmd, "--allow-unauthenticated"],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.ready: dict[str, int] = {}
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        reader.join(60)
        assert self.ready, f"no READY line; log: {log.read_text()[-2000:]}"

    def _read(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if line[:2] == ["READY", "prefill.kv_store_master"]:
            self.ready = {k: int(v) for k, v in (w.split("=", 1) for w in line[2:])}

    @property
    def master_pid(self) -> int:
        return self.ready["master_pid"]


def listening(pid: int) -> set[str]:
    """The addresses process ``pid``'s TCP sockets listen on (hex, as /proc/net/tcp* has them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.add(fields[1].rsplit(":", 1)[0])
    return found


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def test_the_master_process_imports_no_torch() -> None:
    probe = "import sys, services.prefill.kv_store_master; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.strip() == "False", done.stderr


@needs_master
def test_the_master_listens_on_loopback_and_stops_with_its_process(tmp_path) -> None:
    """And ``up``'s check that prefill's ranks lent it their segments fails without them."""
    master = MasterProcess(tmp_path / "master.log")
    try:
        loopback = "0100007F"  # 127.0.0.1
        assert listening(master.master_pid) == {loopback}  # RPC and metrics ports alike
        assert check_liveness(f"127.0.0.1:{master.ready['port']}", 5.0)
        assert kv_store_master.lent_bytes(master.ready["metrics_port"]) == 0  # no client yet
        # up refuses to go on when a prefill rank lent the store nothing
        cfg = LaunchConfig(BUNDLED_MODEL, kv_store_gb=0.5, prefill_cp=2, log_dir=tmp_path)
        store = SimpleNamespace(ready={"metrics_port": str(master.ready["metrics_port"])})
        with pytest.raises(UnavailableError, match="lent the KV store 0 of 1000000000 bytes"):
            Launcher(cfg).check_store(store)
    finally:
        master.process.send_signal(signal.SIGTERM)
        assert master.process.wait(30) == 0
    assert not pid_alive(master.master_pid)  # stopped and reaped, not orphaned


@needs_master
def test_the_masters_death_ends_its_process_and_a_restart_takes_the_same_ports(
    tmp_path,
) -> None:
    first = MasterProcess(tmp_path / "master.log")
    os.kill(first.master_pid, signal.SIGKILL)
    assert first.process.wait(30) == 1  # up restarts it
    ports = {k: first.ready[k] for k in ("port", "metrics_port", "master_port")}
    again = MasterProcess(tmp_path / "master.log", *port_args(ports))
    try:
        assert {k: again.ready[k] for k in ports} == ports
    finally:  # SIGKILL: the master dies with its process (PR_SET_PDEATHSIG)
        again.process.kill()
        again.process.wait()
    assert wait_gone(again.master_pid)
    assert "mooncake_master exited with code" in (tmp_path / "master.log").read_text()


@needs_master
def test_a_failed_start_stops_the_master(tmp_path) -> None:
    cfg = LaunchConfig(BUNDLED_MODEL, kv_store_gb=0.5, log_dir=tmp_path)
    launcher = Launcher(cfg)
    spec = kv_store_spec(cfg)
    assert spec is not None
    try:
        store = launcher.start(spec)
        launcher.wait_ready([store])
        master_pid = int(store.ready["master_pid"])
        failing = launcher.start(ChildSpec("tokenizer", ("--no-such-flag",)))
        with pytest.raises(UnavailableError, match="tokenizer exited with code 2"):
            launcher.wait_ready([failing])
    finally:  # what run_up does once start_all raised
        launcher.stop_all()
    assert store.process.returncode == 0
    assert not pid_alive(master_pid)
    assert "Shutdown signal received" in (tmp_path / "kv_store_master.log").read_text()
