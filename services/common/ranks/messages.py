"""The control channel's messages: leader <-> rank, msgpack on the wire, never pickle.

Two tagged unions, one per direction (``ToRank``, ``ToLeader``), so a message names its
own kind and a decoder rejects anything else. A step's payload and result are the step
class's own msgspec structs, carried as raw msgpack inside the envelope: a payload a rank
cannot decode still leaves the step number readable, so that step fails like any other.

``RankStatus`` is what the ranks all-gather after each step (the agreement, see
``agreement.py``); it never travels to the leader.
"""

from __future__ import annotations

import enum

import msgspec

ANY_FORMATION = -1  # a joining rank's Hello: started on another host, it joins the one forming
NIL = msgspec.Raw(b"\xc0")  # msgpack nil: the result of a step that did not succeed
MAX_ERROR_CHARS = 1000  # an error text longer than this is cut (it must fit a RankStatus)


class StartStage(enum.Enum):
    """Where a rank's start-up failed; named in its start error."""

    DEVICE = "device"
    RENDEZVOUS = "rendezvous"
    SETUP = "setup"
    IMPORT = "import"
    GROUPS = "groups"
    CONSTRUCT = "construct"
    WARMUP = "warmup"
    BARRIER = "barrier"


class StepStatus(enum.Enum):
    """A rank's answer to one step."""

    OK = "ok"  # every rank succeeded: the reply carries this rank's result
    FAILED = "failed"  # some rank failed: the reply carries the agreed error, the group is fine
    BROKEN = "broken"  # this rank could not agree (collective timeout, desync): restart the group


# --- leader -> rank -------------------------------------------------------------------
class Setup(msgspec.Struct, frozen=True, tag="setup"):
    """What a rank needs after its Hello: the rendezvous, its step class and its init."""

    step_target: str  # "package.module:ClassName", a BaseRankStep subclass
    init: msgspec.Raw  # msgpack of the step class's init_type
    first_step: int  # the step number the first StepRequest will carry
    store_host: str  # rank 0's TCPStore
    store_port: int
    collective_timeout_s: float
    leader_timeout_s: float  # a rank that hears nothing from the leader this long exits
    is_free_running: bool = False  # rank 0 steps by itself, ranks 1.. follow (``free_loop.py``)
    step_timeout_s: float = 0.0  # free-running: the deadline of each of its own steps


class StepRequest(msgspec.Struct, frozen=True, tag="step"):
    step: int
    timeout_s: float  # the step's deadline, relative to its receipt
    payload: msgspec.Raw  # msgpack of the step class's payload_type


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """The leader is alive; a rank answers with ``Pong``. ``step``: the last one sent."""

    step: int


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    step: int  # the last step sent


class Post(msgspec.Struct, frozen=True, tag="post"):
    """Commands for a free-running rank, applied at its next step; ``seq``: the leader's number."""

    seq: int
    payload: msgspec.Raw  # msgpack of the step class's payload_type


ToRank = Setup | StepRequest | Ping | Shutdown | Post


# --- rank -> leader -------------------------------------------------------------------
class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """First message of a rank process; rank 0 names its TCPStore port."""

    rank: int
    world_size: int
    formation: int  # the formation the leader started it for
    pid: int
    device: str
    store_port: int  # rank 0: its TCPStore; else 0
    token: str  # STAGESERVE_INTERNAL_TOKEN as the rank sees it


class StartFailed(msgspec.Struct, frozen=True, tag="start_failed"):
    rank: int
    formation: int
    stage: StartStage
    error: str  # "ExceptionType: message"


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Groups formed, step class constructed, warm-up done, every rank past the barrier."""

    rank: int


class StepExecuted(msgspec.Struct, frozen=True, tag="executed"):
    """This rank finished ``execute`` for ``step`` and entered the status exchange."""

    step: int
    rank: int


class StepReply(msgspec.Struct, frozen=True, tag="step_reply"):
    step: int
    rank: int
    status: StepStatus
    result: msgspec.Raw = NIL  # OK: msgpack of the step class's result_type
    error: str = ""  # FAILED: the agreed text (identical on every rank); BROKEN: this rank's cause
    error_type: str = ""  # FAILED: the StageServeError class the failing rank raised, or ""


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    """This rank read a Ping (it is alive and idle); ``step``: the Ping's. Never a step's reply."""

    step: int
    rank: int


class Report(msgspec.Struct, frozen=True, tag="report"):
    """A free-running group's step, sent unsolicited by its rank 0 (only): OK with its result,
    or FAILED (the rank goes on). ``num_posts``: the Posts of this formation applied by it and
    the steps before."""

    step: int
    rank: int
    num_posts: int
    status: StepStatus  # OK or FAILED
    has_work: bool  # it steps again at once (without a Post)
    result: msgspec.Raw = NIL
    error: str = ""
    error_type: str = ""  # FAILED: the StageServeError class the step raised, or ""


ToLeader = Hello | StartFailed | Ready | StepExecuted | StepReply | Pong | Report


# --- rank <-> rank (all-gathered, see agreement.py) ------------------------------------
class RankStatus(msgspec.Struct, frozen=True):
    step: int
    rank: int
    is_ok: bool
    error: str = ""
    error_type: str = ""


_to_rank = msgspec.msgpack.Decoder(ToRank)
_to_leader = msgspec.msgpack.Decoder(ToLeader)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def encode_raw(value: msgspec.Struct) -> msgspec.Raw:
    """A payload, result or init struct, to be nested in an envelope as is."""
    return msgspec.Raw(_encoder.encode(value))


def decode_to_rank(data: bytes) -> ToRank:
    """Raises ``msgspec.DecodeError`` (incl. ``ValidationError``) on anything malformed."""
    return _to_rank.decode(data)


def decode_to_leader(data: bytes) -> ToLeader:
    """Raises ``msgspec.DecodeError`` (incl. ``ValidationError``) on anything malformed."""
    return _to_leader.decode(data)


def cut(text: str) -> str:
    """``text``, cut to ``MAX_ERROR_CHARS``."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


def error_text(exc: BaseException) -> str:
    """``Type: message``, cut to ``MAX_ERROR_CHARS``."""
    return cut(f"{type(exc).__name__}: {exc}")
