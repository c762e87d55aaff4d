"""The overlapped step loop against the synchronous one, on a rank driven command by command.

Each case runs the same requests and the same commands on two ``DecodeRank``s of one
model, one overlapped (step N read after step N+1 is launched), one synchronous, and
checks that every request streams exactly the same tokens and ends the same way, that
these equal the offline engine's where it applies, and that every page comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from services.common import signing
from services.common.types import FinishReason, SamplingParams
from services.decode.app import rank_init
from services.decode.messages import (
    AbortCommand,
    AbortReply,
    Command,
    RankCommands,
    RankReport,
    ReserveCommand,
    StartCommand,
)
from services.decode.rank import DecodeRank, build_rank
from services.engine.llm import EngineRequest
from services.transfer import create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVSender
from tests.decode.conftest import BASE_CONFIG, FakePrefill, prompt_of

PROOF = signing.kv_written_proof(b"k", "any", b"nonce")
MAX_STEPS = 400  # a loop that does not end within this fails the test instead of hanging it


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)  # the first token included
    end: str = ""  # a finish reason, or "aborted"


class Driver:
    """One rank, its stand-in prefill, and what each request streamed."""

    def __init__(self, rank: DecodeRank, prefill: FakePrefill) -> None:
        self.rank, self.prefill = rank, prefill
        self.outcomes: dict[str, Outcome] = {}
        self.num_start_free = rank.load().num_free_pages
        self.num_reads = 0

    def step(self, *commands: Command) -> RankReport:
        report = self.rank.execute(RankCommands(tuple(commands)))
        for request_id, token_id in zip(report.token_request_ids, report.token_ids, strict=True):
            self.outcomes[request_id].tokens.append(token_id)
        for done in report.finished:
            self.outcomes[done.request_id].end = done.reason.value
        self.num_reads += bool(report.num_read_rows)
        load = report.load
        assert (
            load.num_free_pages + load.num_used_pages + load.num_quarantined_pages
            == load.num_total_pages
        )
        return report

    def start(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        reserve = ReserveCommand(request_id, tuple(prompt), params, 0, 60.0, PROOF)
        (reply,) = self.step(reserve).replies
        assert reply.error is None and reply.destination is not None
        first = self.prefill.prefill(request_id, prompt, params, _kv_ref(reply.destination))
        self.outcomes[request_id] = Outcome([first])
        (reply,) = self.step(StartCommand(request_id, first, PROOF)).replies
        assert reply.error is None

    def run_until(self, done: Callable[[], bool], *then: Command) -> None:
        for _ in range(MAX_STEPS):
            if done():
                break
            self.step()
        else:
            raise AssertionError("the condition was not reached")
        for reply in self.step(*then).replies:
            if (
                isinstance(reply, AbortReply)
                and reply.is_found
                and reply.request_id in self.outcomes
            ):
                self.outcomes[reply.request_id].end = "aborted"

    def drain(self) -> None:
        self.run_until(lambda: not self.rank.scheduler.has_work and not self.rank.loop.has_unread)
        load = self.rank.load()
        assert (load.num_free_pages, load.num_used_pages, load.num_quarantined_pages) == (
            self.num_start_free,
            0,
            0,
        )
        assert load.num_running_requests == load.num_reserved_requests == 0


def _kv_ref(destination):
    from services.common.kv_ref import issue_kv_ref

    return issue_kv_ref(destination, b"k", b"n" * 16, int(time.time() * 1000) + 60_000)


@pytest.fixture(scope="module")
def ranks(language_model):
    """An overlapped and a synchronous rank (and their prefills) on one model."""
    made = []
    for is_overlapped in (True, False):
        fabric = InProcessFabric()
        config = replace(BASE_CONFIG, max_model_len=40)
        receiver = create_kv_receiver("inprocess", fabric=fabric)
        rank = build_rank(
            rank_init(config), "cpu", language_model, receiver, is_overlapped=is_overlapped
        )
        rank.warmup()
        made.append((rank, FakePrefill(language_model, InProcessKVSender(fabric))))
    yield made
    for rank, _ in made:
        rank.receiver.close()


def both(
    ranks, scenario: Callable[[Driver], None], eos: frozenset[int] | None = None
) -> dict[str, Outcome]:
    """Run ``scenario`` on both loops; the outcomes, checked equal. ``eos``: the EOS ids to use."""
    results = []
    for rank, prefill in ranks:
        default_eos = rank.scheduler.eos_token_ids
        rank.scheduler.eos_token_ids = eos if eos is not None else default_eos
        try:
            driver = Driver(rank, prefill)
            scenario(driver)
            driver.drain()
            results.append(driver)
        finally:
            rank.scheduler.eos_token_ids = default_eos
    overlapped, synchronous = results
    assert overlapped.outcomes == synchronous.outcomes
    return overlapped.outcomes


def offline_run(offline, prompt: list[int], params: SamplingParams, eos: set[int] | None = None):
    default_eos = offline.eos_token_ids
    offline.eos_token_ids = eos if eos is not None else default_eos
    try:
        (out,) = offline.generate([EngineRequest("offline", prompt, params)])
    finally:
        offline.eos_token_ids = default_eos
    return out.token_ids, out.finish_reason.value


GREEDY_LONG = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def test_eos_read_one_step_late_stops_where_the_synchronous_loop_does(ranks, offline) -> None:
    prompt = prompt_of(6, seed=3)
    reference, _ = offline_run(offline, prompt, GREEDY_LONG)
    eos = reference[5]  # the model "emits EOS" as its 6th token
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    outcomes = both(
        ranks,
        lambda d: (d.start("eos", prompt, params), d.start("other", prompt_of(4, 9), params)),
        eos=frozenset({eos}),
    )
    expected, reason = offline_run(offline, prompt, params, eos={eos})
    assert outcomes["eos"] == Outcome(expected, reason) and reason == "stop" and expected[-1] == eos
    assert len(expected) == reference.index(eos) + 1


def test_stop_token_max_tokens_and_context_limit(ranks, offline) -> None:
    prompt = prompt_of(6, seed=4)
    reference, _ = offline_run(offline, prompt, GREEDY_LONG)
    cases = {
        "stop": (
            prompt,
            SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(reference[3],)),
        ),
        "max-tokens": (
            prompt_of(5, seed=5),
            SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True),
        ),
        "context": (
            prompt_of(30, seed=6),
            SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True),
        ),
        "seeded": (
            prompt_of(8, seed=7),
            SamplingParams(
                temperature=0.9,
                seed=11,
                max_new_tokens=12,
                repetition_penalty=1.2,
                frequency_penalty=0.3,
            ),
        ),
    }

    def scenario(driver: Driver) -> None:
        for request_id, (case_prompt, params) in cases.items():
            driver.start(request_id, case_prompt, params)

    outcomes = both(ranks, scenario)
    offline.max_context_len, default = 40, offline.max_context_len
    try:
        for request_id, (case_prompt, params) in cases.items():
            tokens, reason = offline_run(offline, case_prompt, params)
            assert outcomes[request_id] == Outcome(tokens, reason), request_id
    finally:
        offline.max_context_len = default
    assert outcomes["stop"].end == "stop" and outcomes["context"].end == "length"
    assert len(outcomes["context"].tokens) == 40 - 30 and len(outcomes["max-tokens"].tokens) == 7


def test_abort_ends_with_the_tokens_streamed_so_far(ranks) -> None:
    def scenario(driver: Driver) -> None:
        driver.start("aborted", prompt_of(6, seed=8), GREEDY_LONG)
        driver.start("kept", prompt_of(6, seed=9), GREEDY_LONG)
        driver.run_until(
            lambda: len(driver.outcomes["aborted"].tokens) >= 5, AbortCommand("aborted", False)
        )

    outcomes = both(ranks, scenario)
    assert outcomes["aborted"].end == "aborted" and len(outcomes["aborted"].tokens) == 5
    assert outcomes["kept"].end == "length" and len(outcomes["kept"].tokens) == 20


def test_abort_between_the_step_that_made_a_stop_and_the_step_that_reads_it(ranks, offline) -> None:
    """Overlapped, the step making the stop token is in flight when the abort arrives: the
    request ends aborted with what it had streamed, the stop token never streamed."""
    prompt = prompt_of(6, seed=10)
    reference, _ = offline_run(offline, prompt, GREEDY_LONG)
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=(reference[6],))
    num_before = reference.index(reference[6])  # tokens streamed before the stop token's step

    def scenario(driver: Driver) -> None:
        driver.start("r", prompt, params)
        driver.run_until(
            lambda: len(driver.outcomes["r"].tokens) >= num_before, AbortCommand("r", False)
        )
        if driver.rank.loop.is_overlapped:
            assert driver.rank.scheduler.status("r") is None  # gone while its stop was still unread

    outcomes = both(ranks, scenario)
    assert outcomes["r"] == Outcome(reference[:num_before], "aborted")
    assert reference[6] not in outcomes["r"].tokens


def test_first_token_finishing_and_reserved_aborts_leave_no_page(ranks) -> None:
    def scenario(driver: Driver) -> None:
        driver.start(
            "one", prompt_of(4, seed=12), SamplingParams(temperature=0.0, max_new_tokens=1)
        )
        reserve = ReserveCommand("never", tuple(prompt_of(4, seed=13)), GREEDY_LONG, 0, 60.0, PROOF)
        (reply,) = driver.step(reserve).replies
        assert reply.error is None
        (reply,) = driver.step(AbortCommand("never", is_kv_written=True)).replies
        assert reply.is_found

    outcomes = both(ranks, scenario)
    assert outcomes["one"].end == FinishReason.LENGTH.value and len(outcomes["one"].tokens) == 1


def test_constrained_rows_accept_each_token_one_launch_late(ranks) -> None:
    """JSON-schema rows (their matchers accept a step's tokens at the next launch, once its
    forward is queued) beside a free row, sampled at temperature 1: the overlapped loop streams
    what the synchronous one does, and every output that stops is JSON the schema allows."""
    import json

    from services.common.types import Grammar, GrammarKind

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "c": {"enum": ["x"]}},
        "required": ["n", "c"],
        "additionalProperties": False,
    }
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema), is_strict=True)

    def constrained(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30, grammar=grammar)

    free = SamplingParams(temperature=1.0, seed=5, max_new_tokens=30, ignore_eos=True)
    outcomes = both(
        ranks,
        lambda d: (
            d.start("json-a", prompt_of(5, seed=1), constrained(11)),
            d.start("free", prompt_of(6, seed=2), free),
            d.start("json-b", prompt_of(4, seed=3), constrained(12)),
        ),
    )
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import TINY_MODEL_DIR

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(TINY_MODEL_DIR / "tokenizer.json"))
    for request_id in ("json-a", "json-b"):
        outcome = outcomes[request_id]
        assert outcome.end == "stop", outcome
        value = json.loads(tokenizer.decode(outcome.tokens[:-1]))
        assert set(value) == {"n", "c"} and value["c"] == "x" and 0 <= value["n"] <= 9
    assert outcomes["free"].end == "length" and len(outcomes["free"].tokens) == 30
