"""The rank group's leader side without torch: messages, the agreement and outcome rules,
the config's checks, the restart policy and the liveness rule."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from services.common.errors import CapacityError
from services.common.ranks.agreement import (
    STATUS_BYTES,
    DesyncError,
    agree,
    pack_status,
    unpack_status,
)
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.errors import StepFailedError
from services.common.ranks.liveness import Liveness
from services.common.ranks.messages import (
    MAX_ERROR_CHARS,
    Hello,
    Ping,
    Pong,
    RankStatus,
    Ready,
    Setup,
    Shutdown,
    StartFailed,
    StartStage,
    StepExecuted,
    StepReply,
    StepRequest,
    StepStatus,
    ToLeader,
    ToRank,
    decode_to_leader,
    decode_to_rank,
    encode,
    encode_raw,
    error_text,
)
from services.common.ranks.outcome import step_outcome
from services.common.ranks.restarts import group_restarts
from tests.common.ranks_group_helpers import REPO


class Value(msgspec.Struct, frozen=True):
    value: int


# --- messages ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "message",
    [
        Setup("a.b:C", encode_raw(Value(1)), 5, "127.0.0.1", 1234, 3.0, 10.0),
        StepRequest(step=3, timeout_s=2.0, payload=encode_raw(Value(7))),
        Ping(step=3),
        Shutdown(step=3),
    ],
)
def test_messages_to_a_rank_round_trip(message: ToRank) -> None:
    decoded = decode_to_rank(encode(message))
    assert type(decoded) is type(message)
    assert encode(decoded) == encode(message)


@pytest.mark.parametrize(
    "message",
    [
        Hello(rank=1, world_size=2, formation=3, pid=99, device="cuda:1", store_port=0, token="t"),
        StartFailed(rank=1, formation=3, stage=StartStage.DEVICE, error="RuntimeError: no GPU"),
        Ready(rank=1),
        StepExecuted(step=4, rank=1),
        Pong(step=4, rank=1),
        StepReply(step=4, rank=1, status=StepStatus.OK, result=encode_raw(Value(2))),
        StepReply(
            step=4,
            rank=1,
            status=StepStatus.FAILED,
            error="step 4 failed on rank 0: x",
            error_type="X",
        ),
    ],
)
def test_messages_to_the_leader_round_trip(message: ToLeader) -> None:
    decoded = decode_to_leader(encode(message))
    assert type(decoded) is type(message)
    assert encode(decoded) == encode(message)


def test_a_message_of_the_other_direction_or_garbage_does_not_decode() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_to_leader(encode(Ping(step=1)))
    with pytest.raises(msgspec.ValidationError):
        decode_to_rank(encode(Pong(step=1, rank=0)))
    with pytest.raises(msgspec.DecodeError):
        decode_to_rank(b"\xff\x00garbage")


def test_error_texts_are_cut_to_fit_a_status_row() -> None:
    text = error_text(RuntimeError("é" * 10 * MAX_ERROR_CHARS))
    assert len(text) == MAX_ERROR_CHARS and text.endswith("...")
    row = pack_status(
        RankStatus(step=1, rank=0, is_ok=False, error=text, error_type="CapacityError")
    )
    assert len(row) == STATUS_BYTES
    assert unpack_status(row).error == text


# --- agreement -----------------------------------------------------------------------
def ok(rank: int, step: int = 4) -> RankStatus:
    return RankStatus(step=step, rank=rank, is_ok=True)


def bad(rank: int, error: str, error_type: str = "", step: int = 4) -> RankStatus:
    return RankStatus(step=step, rank=rank, is_ok=False, error=error, error_type=error_type)


def test_agreement_is_none_when_every_rank_succeeded() -> None:
    assert agree([ok(0), ok(1), ok(2)], 4) is None


def test_agreement_names_the_lowest_failing_rank_and_the_others() -> None:
    statuses = [ok(0), bad(1, "RuntimeError: boom", "CapacityError"), bad(2, "ValueError: other")]
    agreed = agree(statuses, 4)
    assert agreed is not None and agreed.error_type == "CapacityError"
    assert agreed.error == "step 4 failed on rank 1: RuntimeError: boom (ranks 2 failed too)"
    assert agree(list(statuses), 4) == agreed  # every rank computes the same from the same rows


@pytest.mark.parametrize("statuses", [[ok(0), ok(1, step=5)], [ok(1), ok(0)], [ok(0), ok(0)]])
def test_agreement_refuses_out_of_sync_rows(statuses: list[RankStatus]) -> None:
    with pytest.raises(DesyncError):
        agree(statuses, 4)


# --- the caller's outcome ------------------------------------------------------------
DECODER = msgspec.msgpack.Decoder(Value)


def reply_ok(rank: int, value: msgspec.Struct) -> StepReply:
    return StepReply(step=4, rank=rank, status=StepStatus.OK, result=encode_raw(value))


def reply_failed(rank: int, error: str, error_type: str = "") -> StepReply:
    return StepReply(
        step=4, rank=rank, status=StepStatus.FAILED, error=error, error_type=error_type
    )


def test_outcome_is_every_ranks_result_in_rank_order() -> None:
    assert step_outcome(4, [reply_ok(0, Value(1)), reply_ok(1, Value(2))], DECODER) == [
        Value(1),
        Value(2),
    ]


def test_outcome_of_a_failed_step_is_the_agreed_error_as_its_class() -> None:
    text = "step 4 failed on rank 1: CapacityError: no pages"
    error = step_outcome(
        4, [reply_failed(0, text, "CapacityError"), reply_failed(1, text, "CapacityError")], DECODER
    )
    assert isinstance(error, CapacityError) and error.message == text
    plain = step_outcome(4, [reply_failed(0, "step 4 failed on rank 0: RuntimeError: x")], DECODER)
    assert (
        type(plain) is StepFailedError
        and plain.message == "step 4 failed on rank 0: RuntimeError: x"
    )


def test_outcome_of_a_malformed_reply_or_result_names_the_rank() -> None:
    malformed = step_outcome(
        4, [reply_ok(0, Value(1)), "rank 1 sent a malformed control message"], DECODER
    )
    assert (
        isinstance(malformed, StepFailedError)
        and malformed.message == "rank 1 sent a malformed control message"
    )
    wrong = step_outcome(4, [reply_ok(0, Value(1)), reply_ok(1, Ping(step=1))], DECODER)
    assert isinstance(wrong, StepFailedError)
    assert wrong.message.startswith("rank 1 sent a malformed result for step 4: ")


# --- config and restart policy -------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "at least one device"),
        ({"devices": ("gpu0",)}, "'cpu', 'cuda:N' or 'join'"),
        ({"devices": ("cpu",), "control_addr": "tcp://0.0.0.0:5000"}, "never a wildcard"),
        ({"devices": ("cpu",), "control_addr": "tcp://10.0.0.1:5000"}, "must be loopback"),
        ({"devices": ("cpu",), "control_addr": "udp://x"}, "is not ipc://PATH"),
        ({"devices": ("cpu",), "step_timeout_s": 0}, "step_timeout_s must be > 0"),
        ({"devices": ("cpu",), "heartbeat_s": 5, "leader_timeout_s": 5}, "must exceed heartbeat_s"),
        ({"devices": ("cpu",), "liveness_timeout_s": 0}, "liveness_timeout_s must be > 0"),
        (
            {"devices": ("cpu",), "heartbeat_s": 2, "liveness_timeout_s": 2},
            "liveness_timeout_s must exceed heartbeat_s",
        ),
        ({"devices": ("cpu",), "rank_module": "-c import os"}, "not a dotted module name"),
    ],
)
def test_config_refuses_what_cannot_run(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankGroupConfig(**kwargs)


def test_a_step_target_must_name_a_class() -> None:
    with pytest.raises(ValueError, match="package.module:ClassName"):
        StepSpec("tests.common.test_ranks_steps", Value, Value(0))


def test_restart_backoff_doubles_up_to_its_cap_and_attempts_are_bounded() -> None:
    policy = group_restarts(
        RankGroupConfig(
            devices=("cpu",),
            max_restart_attempts=4,
            restart_backoff_s=1.0,
            max_restart_backoff_s=3.0,
        )
    )
    assert [policy.next_backoff_s() for _ in range(5)] == [1.0, 2.0, 3.0, 3.0, None]
    policy.reset()
    assert policy.next_backoff_s() == 1.0


# --- liveness: an idle rank that answers no ping ----------------------------------------
def test_an_idle_rank_that_answers_no_ping_for_the_bound_is_named() -> None:
    liveness = Liveness(num_ranks=2, timeout_s=10.0)
    liveness.start(100.0)  # the group became ready
    liveness.answered(0, 105.0)
    assert liveness.deadline_mono(idle_since_mono=0.0) == 110.0  # rank 1's bound
    assert liveness.silent(109.5, idle_since_mono=0.0) is None
    assert liveness.silent(110.0, idle_since_mono=0.0) == (1, 10.0)
    liveness.answered(1, 109.0)
    assert liveness.silent(112.0, idle_since_mono=0.0) is None
    assert liveness.deadline_mono(idle_since_mono=0.0) == 115.0  # now rank 0's
    assert liveness.silent(115.0, idle_since_mono=0.0) == (0, 10.0)


def test_silence_counts_from_the_end_of_the_last_step() -> None:
    liveness = Liveness(num_ranks=2, timeout_s=10.0)
    liveness.start(100.0)
    # A 30 s step ran from 101 to 131: no rank answered a ping meanwhile.
    assert liveness.silent(131.0, idle_since_mono=131.0) is None
    assert liveness.deadline_mono(idle_since_mono=131.0) == 141.0
    assert liveness.silent(141.0, idle_since_mono=131.0) == (0, 10.0)
    liveness.start(150.0)  # a new formation's ranks: the old answers do not count
    assert liveness.silent(155.0, idle_since_mono=131.0) is None


def test_the_leader_imports_no_torch() -> None:
    code = "import sys, services.common.ranks.group; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0
