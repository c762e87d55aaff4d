"""The cache-aware policy: a prompt goes to the prefill worker it sent the prompt's longest
prefix (images included) to, unless that worker is too busy; forgotten workers start over;
other kinds go to the least loaded. And through a router with two fake prefill workers."""

from __future__ import annotations

from services.common.prefix_keys import page_keys
from services.common.types import ImageSpanRef, TokenizedPrompt
from services.router.config import PolicyName
from services.router.policy import CACHE_BLOCK_TOKENS, CacheAwarePolicy
from services.router.workers import Worker, WorkerKind, WorkerState
from tests.router.conftest import (
    MODEL_NAME,
    asgi_client,
    router_config,
    start_cluster,
    start_router,
    stop_router,
)

BLOCK = CACHE_BLOCK_TOKENS


def prefill(address: str, in_flight: int = 0) -> Worker:
    return Worker(WorkerKind.PREFILL, address, state=WorkerState.READY, num_in_flight=in_flight)


def blocks(p: TokenizedPrompt) -> list[bytes]:
    return page_keys(p.token_ids, p.spans, BLOCK)


def prompt(*blocks: int, spans: tuple[ImageSpanRef, ...] = ()) -> TokenizedPrompt:
    """A prompt of whole blocks, block ``b`` of token ``b`` repeated."""
    return TokenizedPrompt(tuple(t for b in blocks for t in [b] * BLOCK), spans)


def test_a_prompt_follows_its_longest_prefix() -> None:
    policy = CacheAwarePolicy(max_imbalance=8)
    workers = [prefill("p0"), prefill("p1")]
    first = policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2, 3))
    other = policy.choose(WorkerKind.PREFILL, workers, prompt(7, 8))
    assert first is not other  # no match: least load ties, taken in turn
    for _ in range(3):  # the conversation grows: it stays where its prefix went
        assert policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2, 3, 4)) is first
        assert policy.choose(WorkerKind.PREFILL, workers, prompt(7, 8, 9)) is other
    assert policy.matched_blocks(first, blocks(prompt(1, 2, 5))) == 2
    assert policy.matched_blocks(other, blocks(prompt(1, 2, 5))) == 0
    assert policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2, 5)) is first


def test_each_image_goes_where_it_went_before() -> None:
    policy = CacheAwarePolicy(max_imbalance=8)
    workers = [prefill("p0"), prefill("p1")]

    def with_image(digest: str) -> TokenizedPrompt:
        return prompt(0, 2, spans=(ImageSpanRef(4, 16, digest, (1, 8, 8)),))

    a = policy.choose(WorkerKind.PREFILL, workers, with_image("a" * 64))
    workers[workers.index(a)].num_in_flight = 1  # busier: another image goes elsewhere
    b = policy.choose(WorkerKind.PREFILL, workers, with_image("b" * 64))
    assert b is not a
    workers[workers.index(b)].num_in_flight = 1
    assert policy.choose(WorkerKind.PREFILL, workers, with_image("a" * 64)) is a
    assert policy.choose(WorkerKind.PREFILL, workers, with_image("b" * 64)) is b


def test_load_wins_over_the_cache_past_the_imbalance() -> None:
    policy = CacheAwarePolicy(max_imbalance=2)
    workers = [prefill("p0"), prefill("p1")]
    home = policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2))
    away = workers[1 - workers.index(home)]
    home.num_in_flight = 2
    assert policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2)) is home  # 2 more: still ok
    home.num_in_flight = 3
    assert policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2)) is away


def test_a_forgotten_worker_starts_over() -> None:
    policy = CacheAwarePolicy(max_imbalance=8)
    workers = [prefill("p0"), prefill("p1")]
    home = policy.choose(WorkerKind.PREFILL, workers, prompt(1, 2))
    assert policy.matched_blocks(home, blocks(prompt(1, 2))) == 2
    policy.forget(home)  # it restarted (turned not ready) or left: its cache is empty
    assert all(policy.matched_blocks(w, blocks(prompt(1, 2))) == 0 for w in workers)


def test_other_kinds_go_to_the_least_loaded() -> None:
    policy = CacheAwarePolicy(max_imbalance=8)
    decodes = [Worker(WorkerKind.DECODE, f"d{i}", state=WorkerState.READY) for i in range(3)]
    decodes[0].num_in_flight = 5
    chosen = [policy.choose(WorkerKind.DECODE, decodes, prompt(1)).address for _ in range(4)]
    assert chosen == ["d1", "d2", "d1", "d2"]


async def test_a_router_sends_each_conversation_to_one_prefill_worker(script) -> None:
    cluster = await start_cluster(script, num_prefills=2)
    app = await start_router(router_config(cluster, policy=PolicyName.CACHE_AWARE))
    texts = [f"Story {n}: " + " ".join(f"word{n}x{i}" for i in range(200)) for n in range(2)]
    try:
        async with asgi_client(app) as http:
            for turn in range(3):
                for text in texts:  # one at a time: no load to balance
                    messages = [{"role": "user", "content": text + " more" * turn}]
                    body = {"model": MODEL_NAME, "messages": messages}
                    reply = await http.post("/v1/chat/completions", json=body)
                    assert reply.status_code == 200, reply.text
        seen = [
            {tuple(r.token_ids[: 2 * BLOCK]) for r in w.servicer.requests} for w in cluster.prefills
        ]
        assert [len(s) for s in seen] == [1, 1]  # each worker got one conversation, 3 turns
        assert [len(w.servicer.requests) for w in cluster.prefills] == [3, 3]
    finally:
        await stop_router(app)
        await cluster.stop()
