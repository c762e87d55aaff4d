"""Prefill first on a shared GPU: while a prefill rank's forward is marked in the GPU share
file, a decode rank holds each step back for at most ``--prefill-first-ms``, reports the wait
(outside its step time) and streams exactly the tokens it streams without the file."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.gpu_share import GpuShare
from services.common.types import SamplingParams
from services.decode.__main__ import parse_config
from services.decode.app import rank_init
from services.decode.messages import RankReport
from services.decode.rank import build_rank
from services.transfer import create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVSender
from tests.decode.conftest import BASE_CONFIG, FakePrefill, prompt_of
from tests.decode.test_step_loop import Driver, Outcome, offline_run

WAIT_MS = 300.0
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)


class RecordingDriver(Driver):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reports: list[RankReport] = []

    def step(self, *commands) -> RankReport:
        report = super().step(*commands)
        self.reports.append(report)
        return report


@pytest.fixture
def shared_rank(language_model, tmp_path):
    """A rank reading the share file ``tmp_path/share``, its prefill, and the file as prefill
    marks it."""
    path = tmp_path / "share"
    config = replace(BASE_CONFIG, gpu_share_file=str(path), prefill_first_ms=WAIT_MS)
    fabric = InProcessFabric()
    receiver = create_kv_receiver("inprocess", fabric=fabric)
    rank = build_rank(rank_init(config), "cpu", language_model, receiver)
    prefill_marks = GpuShare(path)
    yield rank, FakePrefill(language_model, InProcessKVSender(fabric)), prefill_marks
    prefill_marks.close()
    rank.gpu_share.close()
    receiver.close()


def test_steps_wait_for_a_marked_prefill_forward_and_stream_the_same_tokens(
    shared_rank, offline
) -> None:
    rank, prefill, marks = shared_rank
    assert rank.prefill_first_s == WAIT_MS / 1000
    prompt = prompt_of(6, seed=21)
    expected, reason = offline_run(offline, prompt, PARAMS)

    held = RecordingDriver(rank, prefill)
    with marks.marking(0):  # a prefill forward that outlasts every step's bound
        held.start("held", prompt, PARAMS)
        held.drain()
    assert held.outcomes["held"] == Outcome(expected, reason)
    launching = [r for r in held.reports if r.prefill_wait_s > 0]
    assert len(launching) == len(expected) - 1  # every DECODE step waited, once each
    assert all(r.prefill_wait_s >= WAIT_MS / 1000 for r in launching)
    # a step's time is its own: the wait before the next launch is not in it
    read = [r for r in held.reports if r.num_read_rows]
    assert read and all(r.read_step_s < WAIT_MS / 1000 for r in read)

    free = RecordingDriver(rank, prefill)  # no forward marked: no step waits
    free.start("free", prompt, PARAMS)
    free.drain()
    assert free.outcomes["free"] == Outcome(expected, reason)
    assert all(r.prefill_wait_s == 0.0 for r in free.reports)


def test_prefill_first_flags(tmp_path, capsys) -> None:
    path = str(tmp_path / "share")
    assert parse_config(["--gpu-share-file", path]).prefill_first_s == 0.1  # the default
    config = parse_config(["--gpu-share-file", path, "--prefill-first-ms", "0"])
    assert config.prefill_first_s == 0.0
    assert parse_config([]).prefill_first_s == 0.0  # no file: never waits
    refusals = [
        (["--prefill-first-ms", "50"], "--prefill-first-ms needs --gpu-share-file"),
        (
            ["--gpu-share-file", path, "--prefill-first-ms", "-1"],
            "argument --prefill-first-ms: must be >= 0, got -1",
        ),
        (
            ["--gpu-share-file", str(tmp_path / "missing" / "share")],
            f"--gpu-share-file: GPU share file {tmp_path / 'missing' / 'share'}",
        ),
    ]
    for argv, message in refusals:
        with pytest.raises(SystemExit) as exc:
            parse_config(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_a_held_step_waits_with_its_host_work_done(shared_rank, offline, monkeypatch) -> None:
    """The wait sits between the step's attention plan and its forward's launch, so the GPU gets
    the step as soon as prefill's forward ends."""
    rank, prefill, marks = shared_rank
    runner, share = rank.loop.batch.runner, rank.gpu_share
    events: list[str] = []

    def recorded(name, call):
        def run(*args, **kwargs):
            events.append(name)
            return call(*args, **kwargs)

        return run

    prompt = prompt_of(6, seed=22)
    expected, reason = offline_run(offline, prompt, PARAMS)
    driver = RecordingDriver(rank, prefill)
    with marks.marking(0):
        driver.start("held", prompt, PARAMS)
        num_started = len(driver.reports)
        monkeypatch.setattr(runner.attention, "plan", recorded("plan", runner.attention.plan))
        monkeypatch.setattr(share, "wait_for_prefill", recorded("wait", share.wait_for_prefill))
        monkeypatch.setattr(runner.model, "forward", recorded("forward", runner.model.forward))
        driver.drain()
    assert driver.outcomes["held"] == Outcome(expected, reason)
    num_waits = sum(r.prefill_wait_s > 0 for r in driver.reports[num_started:])
    assert num_waits >= 2  # the steps after the start, each held once
    assert "".join(e[0] for e in events) == "pwf" * num_waits
