"""Decode service harness: the leader over real gRPC, its ranks on threads, a stand-in prefill.

``make_decode`` starts a decode service in this process: the real servicer and leader,
``num_ranks`` real ``DecodeRank``s each on its own thread (``LocalRank``), one in-process
KV fabric shared with ``FakePrefill``. The rank-process tests (``test_ranks.py``) start
real rank processes instead.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import pytest

from services.common import signing
from services.common.clients.decode import DecodeChunk, DecodeClient
from services.common.kv_ref import KvRefInfo
from services.common.pb.stageserve.v1 import decode_pb2_grpc
from services.common.ranks.free_supervisor import Reported
from services.common.server import HealthState, create_server
from services.common.types import FinishReason, SamplingParams, Usage
from services.decode.app import rank_init
from services.decode.config import DecodeConfig
from services.decode.leader import DecodeLeader
from services.decode.messages import RankLoad
from services.decode.rank import build_rank
from services.decode.servicer import SERVICE_NAME, DecodeServicer
from services.engine.attention import ForwardMode
from services.engine.grammar import GrammarCache, apply_grammar_masks
from services.engine.llm import EngineRequest, LLMEngine
from services.engine.loader import load_model
from services.engine.model.rope import mrope_positions
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.sampler import Sampler, make_generator
from services.engine.step_inputs import StepInput
from services.transfer import BaseKVSender, create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVSender
from tests.conftest import TINY_MODEL_DIR
from tests.decode.local_ranks import LocalRank

PAGE_SIZE = 4
EOS = 2
KEY = signing.key_of("decode-test-token")  # the internal secret the harness's decode signs with
WAIT_S = 20.0  # bound on every wait: a hang fails the test instead of stalling it


@pytest.fixture(scope="session")
def language_model():
    return load_model(TINY_MODEL_DIR, components=("language",))


@pytest.fixture(scope="session")
def offline(language_model) -> LLMEngine:
    """The single-process engine; it stops on the same EOS ids as decode (the model config's)."""
    return LLMEngine(ModelRunner(language_model, KVCacheConfig(1024, PAGE_SIZE)))


def offline_tokens(
    offline: LLMEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], str]:
    (out,) = offline.generate([EngineRequest("offline", prompt, params)])
    return out.token_ids, out.finish_reason.value


class FakePrefill:
    """What the prefill service does for a text prompt: EXTEND step, first token, KV written to decode."""

    def __init__(self, model, sender: BaseKVSender) -> None:
        self.runner = ModelRunner(model, KVCacheConfig(512, PAGE_SIZE))
        self.sender = sender
        self.sampler = Sampler()
        self.grammars = GrammarCache(TINY_MODEL_DIR)

    def prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams, kv_ref: KvRefInfo
    ) -> int:
        table = self.runner.page_table
        table.reserve(request_id, len(prompt))
        try:
            positions, _ = mrope_positions(len(prompt), [], 2)
            logits = self.runner.forward(
                ForwardMode.EXTEND, [StepInput(request_id, prompt, positions, 0)]
            )
            generator = None if params.is_greedy else make_generator(params.seed, "cpu")
            if params.grammar is None:
                token = self.sampler.sample(logits, [params], [prompt], [[]], [generator]).item()
            else:  # as prefill's worker samples a constrained first token
                penalized = self.sampler.apply_penalties(logits, [params], [prompt], [[]])
                apply_grammar_masks(penalized, [(0, self.grammars.matcher(params.grammar))])
                token = self.sampler.sample_penalized(penalized, [params], [generator]).item()
            destination = kv_ref.to_destination()
            self.sender.send(
                request_id,
                self.runner.kv_pool,
                table.pages(request_id),
                destination,
                time.monotonic() + 10,
            )
            return token
        finally:
            table.release(request_id)


class ShiftedClock:
    """``time.monotonic()`` plus an offset a test moves forward: passes the KV quarantine without waiting."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


@dataclass
class Result:
    token_ids: list[int]  # the first token included
    finish_reason: FinishReason
    usage: Usage
    chunks: list[DecodeChunk] = field(default_factory=list)


def total_load(leader: DecodeLeader) -> RankLoad:
    """The serving ranks' loads, summed (free + used + quarantined = total holds for each)."""
    loads = [load for load in leader.rank_loads() if load is not None]
    fields = [name for name in RankLoad.__struct_fields__ if name.startswith("num_")]
    sums = {name: sum(getattr(load, name) for load in loads) for name in fields}
    return RankLoad(
        page_size=PAGE_SIZE,
        max_model_len=loads[0].max_model_len if loads else 0,
        max_running_requests=sum(load.max_running_requests for load in loads),
        **sums,
    )


@dataclass
class DecodeHarness:
    leader: DecodeLeader
    ranks: list[LocalRank]
    client: DecodeClient
    prefill: FakePrefill
    num_start_free_pages: int
    quarantine_clock: ShiftedClock
    quarantine_s: float

    def stats(self) -> RankLoad:
        return total_load(self.leader)

    async def reserve(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        deadline_in_s: float = 30.0,
    ):
        return await self.client.reserve(request_id, prompt, 0, params, time.time() + deadline_in_s)

    def generate(self, kv_ref: KvRefInfo, first_token_id: int) -> AsyncIterator[DecodeChunk]:
        """Generate for ``kv_ref``'s request with the proof prefill returns once its KV landed."""
        proof = signing.kv_written_proof(KEY, kv_ref.request_id, kv_ref.nonce)
        return self.client.generate(
            kv_ref.request_id, first_token_id, timeout_s=WAIT_S, kv_written_proof=proof
        )

    async def reserve_and_prefill(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> tuple[KvRefInfo, int]:
        """Reserve ``request_id`` and prefill it (its KV written to decode): its kv_ref and
        first token, what ``generate`` takes."""
        kv_ref = await self.reserve(request_id, prompt, params)
        return kv_ref, self.prefill.prefill(request_id, prompt, params, kv_ref)

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams) -> Result:
        kv_ref, first = await self.reserve_and_prefill(request_id, prompt, params)
        chunks = [chunk async for chunk in self.generate(kv_ref, first)]
        tokens = [first] + [t for chunk in chunks for t in chunk.token_ids]
        assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
        return Result(tokens, chunks[-1].finish_reason, chunks[-1].usage, chunks)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        deadline_mono = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline_mono, "condition not reached in time"
            await asyncio.sleep(0.01)

    async def wait_all_pages_free(self) -> None:
        await self.wait_for(lambda: self.stats().num_free_pages == self.num_start_free_pages)

    async def pass_quarantine(self) -> None:
        """Move the quarantine clock past ``kv_quarantine_s``; the rank's timer returns every
        quarantined page."""
        self.quarantine_clock.offset_s += self.quarantine_s
        await self.wait_for(lambda: self.stats().num_quarantined_pages == 0)


MakeDecode = Callable[..., Awaitable[DecodeHarness]]

BASE_CONFIG = DecodeConfig(
    num_pages=256,
    page_size=PAGE_SIZE,
    transfer_backend="inprocess",
    watchdog_s=30.0,
)


@pytest.fixture
async def make_decode(language_model) -> AsyncIterator[MakeDecode]:
    """Start decode services (real gRPC on port 0); each ends with every page free, quarantine
    passed.

    ``num_ranks`` DP ranks (each on its own thread); ``is_overlapped=False`` runs the
    synchronous loop; other keywords override ``BASE_CONFIG``.
    """
    started: list[tuple[DecodeHarness, object]] = []

    async def factory(
        num_ranks: int = 1, is_overlapped: bool = True, **overrides: object
    ) -> DecodeHarness:
        config = replace(BASE_CONFIG, **overrides)
        fabric, clock = InProcessFabric(), ShiftedClock()
        ranks: list[LocalRank] = []

        def make_rank(
            dp_rank: int,
            on_ready_change: Callable[[bool], None],
            on_report: Callable[[Reported], None],
        ) -> LocalRank:
            def build():
                receiver = create_kv_receiver("inprocess", fabric=fabric)
                return build_rank(
                    rank_init(config), "cpu", language_model, receiver, clock, is_overlapped
                )

            rank = LocalRank(build, on_ready_change, on_report, f"decode-rank-{dp_rank}")
            ranks.append(rank)
            return rank

        leader = DecodeLeader(num_ranks, make_rank, config.watchdog_s)
        await leader.start()
        servicer = DecodeServicer(
            config.reservation_timeout_s, config.max_reservation_s, KEY, leader
        )
        server, port = create_server(
            [(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)],
            0,
            "127.0.0.1",
            [SERVICE_NAME],
            health=HealthState(),
        )
        await server.start()
        harness = DecodeHarness(
            leader,
            ranks,
            DecodeClient(f"127.0.0.1:{port}"),
            FakePrefill(language_model, InProcessKVSender(fabric)),
            total_load(leader).num_free_pages,
            clock,
            config.kv_quarantine_s,
        )
        started.append((harness, server))
        return harness

    yield factory
    for harness, server in started:
        await harness.pass_quarantine()
        await harness.wait_all_pages_free()
        await harness.client.close()
        await server.stop(0)
        await harness.leader.stop()


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2048) for _ in range(length)]
