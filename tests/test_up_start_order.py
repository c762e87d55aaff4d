"""``up`` starts prefill once the vision encoder listens (its LISTENING line), not once it is
READY: prefill's ranks load the model while the encoder's do, and prefill waits for the
encoder's SERVING itself; ``up`` is up only when every service printed READY."""

from __future__ import annotations

import io
import threading
import time
from types import SimpleNamespace

from services.launch_child import Child
from services.launch_spec import ChildSpec, LaunchConfig
from services.launcher import Launcher


def fake_child(spec: ChildSpec) -> Child:
    """A child whose lines the test writes into ``ready`` / ``listening`` (no process)."""
    return Child(spec, SimpleNamespace(poll=lambda: None, pid=1), {})


def test_prefill_starts_when_the_encoder_listens_and_up_waits_for_every_ready() -> None:
    launcher, started, events = Launcher(LaunchConfig()), {}, []

    def start(spec: ChildSpec) -> Child:
        child = fake_child(spec)
        started[spec.name] = child
        events.append(f"start {spec.name}")
        if spec.name == "router":
            child.ready = {"port": "1", "http_port": "2"}
        return child

    launcher.start = start  # type: ignore[method-assign]
    launcher.write_state = lambda: None  # type: ignore[method-assign]
    done = threading.Thread(target=launcher.start_all, daemon=True)
    done.start()

    def wait_for(name: str) -> Child:
        deadline_mono = time.monotonic() + 10
        while name not in started:
            assert time.monotonic() < deadline_mono, f"{name} never started: {events}"
            time.sleep(0.01)
        return started[name]

    for name in ("tokenizer", "decode"):
        wait_for(name).ready = {"port": "1"}
    time.sleep(0.3)
    assert "start prefill" not in events  # the encoder has no port yet
    wait_for("vision_encoder").listening = {"port": "7"}
    prefill = wait_for("prefill")
    assert "127.0.0.1:7" in " ".join(prefill.spec.args)  # the address from LISTENING
    time.sleep(0.3)
    assert "start router" not in events  # the encoder is not READY yet
    started["vision_encoder"].ready = {"port": "7"}
    prefill.ready = {"port": "9"}
    wait_for("router")
    done.join(10)
    assert not done.is_alive()


def test_the_launcher_reads_listening_and_ready_lines_of_its_own_service() -> None:
    child = Child(ChildSpec("vision_encoder", (), {}), SimpleNamespace(), {})
    child.process.stdout = io.StringIO(
        "LISTENING prefill port=1\nLISTENING vision_encoder port=5\nnoise\n"
        "READY vision_encoder port=5 metrics_port=6\nLISTENING vision_encoder port=8\n"
    )
    child.read_stdout()
    assert child.listening == {"port": "5"}
    assert child.ready == {"port": "5", "metrics_port": "6"}
    assert child.address == "127.0.0.1:5"
