"""Decode as processes: ``python -m services.decode --ranks D`` (the leader) and its D rank
processes, KV written into each rank's own pool through shared memory by a stand-in prefill.

Every request's tokens equal the offline engine's whichever rank it lands on (greedy and
seeded, text and images); Reserve spreads over the ranks; decode sends at most one message
per rank step to one caller; a rank SIGKILLed mid-stream ends its own requests with an
error in bounded time while the other rank's finish, and it serves again after its restart.
One decode process per D serves every test of that D.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from services.common import signing
from services.common.auth import Credentials
from services.common.clients.decode import DecodeClient
from services.common.errors import UnavailableError
from services.common.kv_ref import KvRefInfo
from services.common.types import SamplingParams
from services.engine.attention import ForwardMode
from services.engine.llm import EngineRequest, LLMEngine
from services.engine.model.rope import mrope_positions
from services.engine.offline import OfflinePipeline
from services.engine.sampler import make_generator
from services.transfer import BaseKVSender
from services.transfer.shm_backend import ShmKVSender
from tests.conftest import REPO, TINY_MODEL_DIR, image_bytes
from tests.decode.conftest import PAGE_SIZE, prompt_of
from tests.decode.test_main import read_ready_line

pytestmark = pytest.mark.slow
TOKEN = "decode-ranks-test-token"
KEY = signing.key_of(TOKEN)
READY_TIMEOUT_S = 300.0  # D rank processes importing torch at once on 2 loaded cores
BOUND_S = 60.0  # generous bound on "ends in bounded time"; a hang would wait forever


@dataclass
class Decode:
    process: subprocess.Popen
    address: str
    metrics_port: int
    num_ranks: int

    def client(self) -> DecodeClient:
        return DecodeClient(self.address, auth=Credentials(TOKEN))

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10
        ) as reply:
            text = reply.read().decode()
        return sum(
            float(m.group(1))
            for m in re.finditer(rf"^stageserve_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        )

    def rank_pids(self) -> list[int]:
        pids = []
        for entry in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if parent == self.process.pid and b"rank_main" in f.read():
                        pids.append(int(entry))
        return pids


@contextlib.contextmanager
def decode_process(num_ranks: int, log_path, *flags: str) -> Iterator[Decode]:
    """``python -m services.decode --ranks num_ranks`` with ``flags``, until SIGTERM (exit 0)."""
    log = log_path.open("w")
    env = {**os.environ, "STAGESERVE_INTERNAL_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.decode",
            "--ranks",
            str(num_ranks),
            "--num-pages",
            "1024",
            "--page-size",
            str(PAGE_SIZE),
            "--kv-quarantine-s",
            "0.5",
            *flags,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    try:
        match = read_ready_line(process, READY_TIMEOUT_S)
        yield Decode(process, f"127.0.0.1:{match.group(1)}", int(match.group(2)), num_ranks)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda d: f"D{d}")
def decode(request, tmp_path_factory) -> Iterator[Decode]:
    log_path = tmp_path_factory.mktemp(f"decode-d{request.param}") / "decode.log"
    with decode_process(request.param, log_path, "--transfer-backend", "shm") as running:
        yield running


def make_pipeline(device: str = "cpu", **engine_kwargs) -> OfflinePipeline:
    """The offline engine (the reference) and the stand-in prefill's model."""
    return OfflinePipeline.from_dir(
        TINY_MODEL_DIR, page_size=PAGE_SIZE, device=device, **engine_kwargs
    )


@pytest.fixture(scope="module")
def pipeline() -> OfflinePipeline:
    return make_pipeline()


class Prefill:
    """What the prefill service does: the prompt's EXTEND (image embeddings merged), first token, KV
    sent."""

    def __init__(self, engine: LLMEngine, sender: BaseKVSender | None = None) -> None:
        self.engine = engine
        self.sender = sender or ShmKVSender()

    def rope_delta(self, request: EngineRequest) -> int:
        merge = self.engine.config.vision.spatial_merge_size
        return mrope_positions(len(request.prompt_ids), request.spans, merge)[1]

    def prefill(self, request: EngineRequest, kv_ref: KvRefInfo) -> int:
        engine, table = self.engine, self.engine.runner.page_table
        table.reserve(request.request_id, len(request.prompt_ids))
        try:
            step, _ = engine.prefill_input(request, engine.image_embeddings([request])[0])
            logits = engine.runner.forward(ForwardMode.EXTEND, [step])
            params = request.params
            generator = (
                None if params.is_greedy else make_generator(params.seed, engine.runner.device)
            )
            token = engine.sampler.sample(
                logits, [params], [request.prompt_ids], [[]], [generator]
            ).item()
            pages = table.pages(request.request_id)
            for destination in kv_ref.to_destinations():  # each TP rank's pool: its heads
                self.sender.send(
                    request.request_id,
                    engine.runner.kv_pool,
                    pages,
                    destination,
                    time.monotonic() + 10,
                )
            return token
        finally:
            table.release(request.request_id)


async def generate(
    client: DecodeClient, prefill: Prefill, request: EngineRequest
) -> tuple[list[int], str, int]:
    """(tokens with the first, finish reason, dp_rank) of one request through decode."""
    kv_ref = await client.reserve(
        request.request_id,
        request.prompt_ids,
        prefill.rope_delta(request),
        request.params,
        time.time() + BOUND_S,
    )
    tokens = [prefill.prefill(request, kv_ref)]
    proof = signing.kv_written_proof(KEY, request.request_id, kv_ref.nonce)
    reason = ""
    async for chunk in client.generate(
        request.request_id, tokens[0], BOUND_S, kv_written_proof=proof
    ):
        tokens += chunk.token_ids
        reason = chunk.finish_reason.value if chunk.finish_reason else reason
    return tokens, reason, kv_ref.dp_rank


def chat_request(
    pipeline: OfflinePipeline, request_id: str, text: str, images: list[bytes], params
) -> EngineRequest:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return pipeline.build_request(
        [{"role": "user", "content": content}], images, params, request_id
    )


async def all_running(
    client: DecodeClient, prefill: Prefill, requests: list[EngineRequest]
) -> list[asyncio.Future]:
    """``requests`` generating through decode, returned once every one of them runs there."""
    tasks = [asyncio.ensure_future(generate(client, prefill, r)) for r in requests]
    deadline_mono = time.monotonic() + BOUND_S
    while (await client.stats()).num_running_requests < len(requests):
        assert time.monotonic() < deadline_mono, "the requests did not all start"
        await asyncio.sleep(0.05)
    return tasks


def resume(pid: int) -> None:
    """SIGCONT to a process a test stopped, if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def wait_idle(decode: Decode, client: DecodeClient) -> None:
    """Every rank serves with every page free (quarantine passed)."""
    deadline_mono = time.monotonic() + BOUND_S
    while True:
        stats = await client.stats()
        if len(stats.ranks) == decode.num_ranks and all(
            r.is_serving and r.num_free_pages == r.num_total_pages for r in stats.ranks
        ):
            return
        assert time.monotonic() < deadline_mono, f"decode did not come back idle: {stats}"
        await asyncio.sleep(0.1)


async def test_every_request_matches_the_offline_engine_on_whichever_rank(decode, pipeline) -> None:
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, seed=42, max_new_tokens=12, repetition_penalty=1.2
    )
    requests = [
        chat_request(
            pipeline,
            f"text-{i}",
            f"Tell me about ship number {i}.",
            [],
            greedy if i % 2 else seeded,
        )
        for i in range(2 * decode.num_ranks)
    ] + [
        chat_request(
            pipeline,
            "one-image",
            "What is in this picture?",
            [image_bytes(120, 80, seed=1)],
            greedy,
        ),
        chat_request(
            pipeline,
            "two-images",
            "Compare them.",
            [image_bytes(64, 100, seed=2), image_bytes(90, 60, seed=3)],
            seeded,
        ),
    ]
    prefill, client = Prefill(pipeline.engine), decode.client()
    try:
        results = await asyncio.gather(*(generate(client, prefill, r) for r in requests))
        for request, (tokens, reason, _) in zip(requests, results, strict=True):
            (expected,) = pipeline.engine.generate([request])
            assert (tokens, reason) == (expected.token_ids, expected.finish_reason.value), (
                request.request_id
            )
        assert {dp_rank for _, _, dp_rank in results} == set(range(decode.num_ranks))
        await wait_idle(decode, client)
    finally:
        await client.close()


async def test_reserve_spreads_over_the_ranks(decode) -> None:
    client = decode.client()
    params = SamplingParams(max_new_tokens=8)
    try:
        kv_refs = [
            await client.reserve(f"spread-{i}", prompt_of(6, i), 0, params, time.time() + BOUND_S)
            for i in range(20)
        ]
        stats = await client.stats()
        assert [r.num_reserved_requests for r in stats.ranks] == [
            sum(k.dp_rank == r for k in kv_refs) for r in range(decode.num_ranks)
        ]
        assert max(r.num_reserved_requests for r in stats.ranks) <= -(-20 // decode.num_ranks) + 2
        for kv_ref in kv_refs:
            assert kv_ref.has_valid_mac(KEY) and kv_ref.session_id.startswith("shm:")
            assert await client.abort(kv_ref.request_id, "test", is_kv_written=True)
        await wait_idle(decode, client)
    finally:
        await client.close()


async def test_one_message_per_rank_step_to_one_caller(decode, pipeline) -> None:
    """64 concurrent streaming requests on one client (one router process): decode sends it at
    most one message per rank step, whatever the number of requests."""
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    requests = [EngineRequest(f"many-{i}", prompt_of(5, 100 + i), params) for i in range(64)]
    prefill, client = Prefill(pipeline.engine), decode.client()
    try:
        messages, steps = (
            decode.metric("decode_stream_messages_total"),
            decode.metric("decode_steps_total"),
        )
        results = await asyncio.gather(*(generate(client, prefill, r) for r in requests))
        assert all(len(tokens) == 24 for tokens, _, _ in results)
        messages = decode.metric("decode_stream_messages_total") - messages
        steps = decode.metric("decode_steps_total") - steps
        assert 0 < messages <= steps
        assert steps < 64 * 23  # batched: far fewer steps than tokens
        await wait_idle(decode, client)
    finally:
        await client.close()


@pytest.mark.parametrize("decode", [2], indirect=True, ids=["D2"])
async def test_a_rank_killed_mid_stream_fails_its_requests_and_comes_back(decode, pipeline) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=300, ignore_eos=True)
    requests = [EngineRequest(f"kill-{i}", prompt_of(5, 200 + i), params) for i in range(6)]
    prefill, client = Prefill(pipeline.engine), decode.client()
    try:
        tasks = await all_running(client, prefill, requests)
        victim = decode.rank_pids()[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND_S)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        finished = [o for o in outcomes if not isinstance(o, BaseException)]
        assert failed and finished, outcomes
        assert all(
            isinstance(o, UnavailableError) and "did not finish" in o.message for o in failed
        ), failed
        assert time.monotonic() - killed_at < BOUND_S
        for tokens, reason, _ in finished:  # the other rank's streams are whole
            assert (len(tokens), reason) == (300, "length")
        assert len({dp_rank for _, _, dp_rank in finished}) == 1
        await wait_idle(decode, client)  # restarted: serving again, its pool whole
        assert victim not in decode.rank_pids() and len(decode.rank_pids()) == 2
        tokens, reason, _ = await generate(
            client, prefill, EngineRequest("after", prompt_of(5, 1), params)
        )
        assert (len(tokens), reason) == (300, "length")
    finally:
        await client.close()
