"""DP attention with one DP rank's local state made to differ from the other's on purpose
(issue 37): when the group steps comes from gathered and agreed state, never from one rank's
queue, timers or pool.

One decode process (``--dp-attention`` over the tiny MoE checkpoint, ``--ep 2``, four batch
slots per rank). The leader's placement (most free pages, then fewest requests, then DP rank
0) is steered so that DP rank 0 holds one long stream and DP rank 1 everything else:
1. busy: rank 1 runs ten streams on its four slots (six wait for one) next to a reservation
   that expires and one held, while rank 0 runs its one stream;
2. rank 0 idle, with no timer of its own, and rank 1 holding a reservation about to expire:
   only rank 1's gathered timer can make rank 0 start the group step that expires it, and
   the one that brings its quarantined pages back;
3. the same with the pages of a reservation of rank 1 aborted unwritten.

The group runs with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: torch checks every collective's
fingerprint (sequence number, op, shapes) across the two ranks before running it, so a rank
that started a forward (or a rows agreement) the other skipped, or ran other rows, fails its
step at once, and the leader fails the group and re-forms it. The test asserts it never
re-forms (same rank processes, formation 1, no rank failure), every stream ends with the
offline engine's tokens within its deadline, each rank-1 timer is acted on in bounded time,
and both pools end where they started.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from services.common import signing
from services.common.clients.decode import DecodeClient, DecodeRankStats
from services.common.errors import NotFoundError
from services.common.kv_ref import KvRefInfo
from services.common.types import SamplingParams
from services.engine.llm import EngineRequest
from services.engine.offline import OfflinePipeline
from tests.decode.conftest import PAGE_SIZE, prompt_of
from tests.decode.test_dp_attention import MOE_DIR, expect_offline, rank_pids_by_rank
from tests.decode.test_ranks import KEY, Decode, Prefill, decode_process, wait_idle

pytestmark = pytest.mark.slow
NUM_PAGES = 256  # per DP rank
MAX_RUNNING = 4  # rank 1 gets more streams than this: some wait for a slot
QUARANTINE_S = 0.5  # decode_process's --kv-quarantine-s
DEADLINE_S = 30.0  # every request's; a group out of step would hang past it
# the longest a rank-1 timer may wait past its due time: a liveness bound with room for a
# loaded machine (a timer rank 0 does not act on never comes: the wait fails at WAIT_S)
TIMER_BOUND_S = 10.0
WAIT_S = 30.0
LATE_S = 1.5  # phase 2's reservation lifetime


@pytest.fixture(scope="module")
def diverged(tmp_path_factory) -> Iterator[tuple[Decode, OfflinePipeline, str]]:
    log_path = tmp_path_factory.mktemp("decode-dpa-divergence") / "decode.log"
    pipeline = OfflinePipeline.from_dir(MOE_DIR, page_size=PAGE_SIZE)
    args = (
        "--model",
        str(MOE_DIR),
        "--dp-attention",
        "--ep",
        "2",
        "--transfer-backend",
        "shm",
        "--watchdog-s",
        "10",
        "--num-pages",
        str(NUM_PAGES),  # after decode_process's own --num-pages: this one counts
        "--max-running-requests",
        str(MAX_RUNNING),
    )
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:  # only the decode process and its ranks
            env.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
            running = stack.enter_context(decode_process(2, log_path, *args))
        yield running, pipeline, str(log_path)


def metric(decode: Decode, name: str, **labels: str) -> float:
    """The sum of ``stageserve_<name>``'s samples whose labels include ``labels``."""
    with urllib.request.urlopen(
        f"http://127.0.0.1:{decode.metrics_port}/metrics", timeout=10
    ) as reply:
        text = reply.read().decode()
    total = 0.0
    for match in re.finditer(rf"^stageserve_{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def rank_stats(client: DecodeClient) -> list[DecodeRankStats]:
    stats = await client.stats()
    return sorted(stats.ranks, key=lambda r: r.dp_rank)


async def reserve(
    client: DecodeClient, prefill: Prefill, request: EngineRequest, lifetime_s: float
) -> KvRefInfo:
    return await client.reserve(
        request.request_id,
        request.prompt_ids,
        prefill.rope_delta(request),
        request.params,
        time.time() + lifetime_s,
    )


async def stream(
    client: DecodeClient, request: EngineRequest, kv_ref: KvRefInfo, first: int
) -> tuple[list[int], str, int]:
    """(tokens with the first, finish reason, dp_rank) of a reserved and prefilled request."""
    proof = signing.kv_written_proof(KEY, request.request_id, kv_ref.nonce)
    tokens, reason = [first], ""
    async for chunk in client.generate(
        request.request_id, first, DEADLINE_S, kv_written_proof=proof
    ):
        tokens += chunk.token_ids
        reason = chunk.finish_reason.value if chunk.finish_reason else reason
    return tokens, reason, kv_ref.dp_rank


async def until(
    client: DecodeClient, predicate: Callable[[list[DecodeRankStats]], bool], what: str
) -> list[DecodeRankStats]:
    """The ranks' stats once ``predicate`` holds (polled)."""
    deadline_mono = time.monotonic() + WAIT_S
    while True:
        ranks = await rank_stats(client)
        if predicate(ranks):
            return ranks
        assert time.monotonic() < deadline_mono, f"{what}: not reached ({ranks})"
        await asyncio.sleep(0.01)


async def test_one_rank_diverging_on_purpose_steps_in_lockstep(diverged) -> None:
    decode, pipeline, log_path = diverged
    prefill, client = Prefill(pipeline.engine), decode.client()
    pids = rank_pids_by_rank(decode)
    assert sorted(pids) == [0, 1]
    for pid in pids.values():  # every collective of the group is checked across the ranks
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert b"TORCH_DISTRIBUTED_DEBUG=DETAIL" in f.read().split(b"\0")
    try:
        await wait_idle(decode, client)
        start = await rank_stats(client)
        assert [(r.num_free_pages, r.num_total_pages) for r in start] == [(NUM_PAGES,) * 2] * 2
        failures = metric(decode, "decode_rank_failures_total")
        expired = metric(decode, "decode_requests_total", outcome="expired")
        steps = [metric(decode, "decode_steps_total", dp_rank=str(r)) for r in (0, 1)]

        # 1. busy, diverged. The first Reserve goes to rank 0 (a tie); the anchor's 150 pages
        # then send every later one to rank 1, which keeps more free pages
        anchor = EngineRequest(
            "anchor",
            prompt_of(480, 1),
            SamplingParams(temperature=0.0, max_new_tokens=120, ignore_eos=True),
        )
        held = SamplingParams(max_new_tokens=100)  # 30 pages with a 20-token prompt
        left = EngineRequest("left", prompt_of(20, 2), held)  # expires, never started
        dropped = EngineRequest("dropped", prompt_of(20, 3), held)  # aborted unwritten (3.)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=24)  # 8 pages each
        seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=24)
        many = [
            EngineRequest(f"many-{i}", prompt_of(6, 10 + i), [greedy, seeded][i % 2])
            for i in range(10)
        ]
        kv_refs = {"anchor": await reserve(client, prefill, anchor, DEADLINE_S)}
        kv_refs["left"] = await reserve(client, prefill, left, 2.0)
        kv_refs["dropped"] = await reserve(client, prefill, dropped, 120.0)
        for request in many:
            kv_refs[request.request_id] = await reserve(client, prefill, request, DEADLINE_S)
        assert {k: v.dp_rank for k, v in kv_refs.items()} == {
            k: int(k != "anchor") for k in kv_refs
        }
        placed = await rank_stats(client)
        assert [(r.num_reserved_requests, r.num_free_pages) for r in placed] == [
            (1, NUM_PAGES - 150),
            (12, NUM_PAGES - 2 * 30 - 10 * 8),
        ]
        # every stream's KV written, then all started at once: rank 0 one stream, rank 1 ten
        # on four slots (six wait), its reservation expiring meanwhile
        streams = [anchor, *many]
        firsts = {r.request_id: prefill.prefill(r, kv_refs[r.request_id]) for r in streams}
        tasks = [
            asyncio.ensure_future(stream(client, r, kv_refs[r.request_id], firsts[r.request_id]))
            for r in streams
        ]
        seen_queued = False  # rank 1 with work past its batch while rank 0 runs one request
        while not all(t.done() for t in tasks):
            zero, one = await rank_stats(client)
            seen_queued |= zero.num_running_requests == 1 and one.num_running_requests > MAX_RUNNING
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)  # none raised DeadlineExceeded
        assert seen_queued, "rank 1 never had requests waiting for a slot"
        assert [dp_rank for _, _, dp_rank in results] == [0] + [1] * len(many)
        await until(
            client,
            lambda rs: rs[1].num_reserved_requests == 1 and rs[1].num_quarantined_pages == 0,
            "left expired, its pages back",
        )
        with pytest.raises(NotFoundError, match="left"):  # expired: no generate for it
            await stream(client, left, kv_refs["left"], 7)

        # 2. rank 0 idle, rank 1 a reservation due: only its gathered timer makes the group
        # step. A reservation pinned on rank 0 sends the next Reserve to rank 1, then goes
        pin = EngineRequest("pin", prompt_of(20, 4), SamplingParams(max_new_tokens=380))
        kv_refs["pin"] = await reserve(client, prefill, pin, DEADLINE_S)
        late = EngineRequest("late", prompt_of(20, 5), held)
        reserved_mono = time.monotonic()
        kv_refs["late"] = await reserve(client, prefill, late, LATE_S)
        assert (kv_refs["pin"].dp_rank, kv_refs["late"].dp_rank) == (0, 1)
        assert await client.abort("pin", "test", is_kv_written=True)  # freed at once
        alone = await rank_stats(client)
        assert [
            (r.num_running_requests, r.num_reserved_requests, r.num_quarantined_pages)
            for r in alone
        ] == [(0, 0, 0), (0, 2, 0)]
        assert alone[0].num_free_pages == NUM_PAGES
        await until(client, lambda rs: rs[1].num_reserved_requests == 1, "late expired")
        expired_s = time.monotonic() - reserved_mono
        assert LATE_S - 0.01 <= expired_s < LATE_S + TIMER_BOUND_S, expired_s
        await until(client, lambda rs: rs[1].num_quarantined_pages == 0, "late's pages back")
        released_s = time.monotonic() - reserved_mono
        assert LATE_S + QUARANTINE_S - 0.01 <= released_s, released_s
        assert released_s < LATE_S + QUARANTINE_S + TIMER_BOUND_S, released_s

        # 3. the same with quarantined pages: an unwritten reservation of rank 1 aborted
        aborted_mono = time.monotonic()
        assert await client.abort("dropped", "test", is_kv_written=False)
        assert [r.num_quarantined_pages for r in await rank_stats(client)] == [0, 30]
        await until(client, lambda rs: rs[1].num_quarantined_pages == 0, "dropped's pages back")
        released_s = time.monotonic() - aborted_mono
        assert QUARANTINE_S - 0.01 <= released_s < QUARANTINE_S + TIMER_BOUND_S, released_s

        await wait_idle(decode, client)
        end = await rank_stats(client)
        counts = ("num_free_pages", "num_used_pages", "num_quarantined_pages")
        assert [[getattr(r, c) for c in counts] for r in end] == [
            [getattr(r, c) for c in counts] for r in start
        ]
        assert [(r.num_running_requests, r.num_reserved_requests) for r in end] == [(0, 0)] * 2
        # never re-formed: the same rank processes, formation 1, no failed step
        assert rank_pids_by_rank(decode) == pids
        assert metric(decode, "decode_rank_failures_total") == failures
        with open(log_path) as f:
            log = f.read()
        assert re.findall(r"forming formation (\d+)", log) == ["1"]
        assert " ERROR " not in log and "Detected mismatch" not in log, log[-4000:]
        assert metric(decode, "decode_requests_total", outcome="expired") == expired + 2
        # rank 0 read one step per anchor token after prefill's first; rank 1 one per step
        # with rows of its own: at least the longest stream's, at most one per token
        rank_steps = [
            metric(decode, "decode_steps_total", dp_rank=str(r)) - steps[r] for r in (0, 1)
        ]
        assert rank_steps[0] == 119
        tokens_one = [len(tokens) - 1 for tokens, _, _ in results[1:]]
        assert max(tokens_one) <= rank_steps[1] <= sum(tokens_one)
        expect_offline(pipeline, streams, results)
    finally:
        await client.close()
