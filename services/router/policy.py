"""Routing policies: which ready worker of a kind gets the next request.

``cache-aware`` sends a prompt to the prefill worker most likely to hold its longest prefix
in its prefix cache: the router keeps, per prefill worker, the blocks of the prompts it
sent there (``page_keys`` over ``CACHE_BLOCK_TOKENS``-token blocks, image content hashes
included, so a conversation's follow-ups and an image's repeats go where the image is),
least recently sent out first. The record is approximate (the worker's own cache evicts on
its own schedule; a worker that turns not ready is forgotten, as a restarted one holds
nothing), and load wins over it: a worker more than ``max_imbalance`` requests busier than
the least loaded one gets nothing for its cache. Other kinds go to the least loaded.
"""

from __future__ import annotations

import abc
import itertools
from collections import OrderedDict
from collections.abc import Sequence

from services.common.prefix_keys import page_keys
from services.common.types import TokenizedPrompt
from services.router.config import PolicyName
from services.router.workers import Worker, WorkerKind

CACHE_BLOCK_TOKENS = 64  # the router's block: coarser than prefill's pages, as cheap to hash
MAX_BLOCKS_PER_WORKER = 1 << 16  # blocks recorded per prefill worker (more than a pool holds)


class BaseRoutingPolicy(abc.ABC):
    @abc.abstractmethod
    def choose(
        self, kind: WorkerKind, candidates: Sequence[Worker], prompt: TokenizedPrompt | None = None
    ) -> Worker:
        """Pick one of ``candidates`` (ready workers of ``kind``, in configured order, never
        empty) for a request with ``prompt`` (None: not known or not used)."""

    def forget(self, worker: Worker) -> None:  # noqa: B027 (a no-op unless a policy records)
        """``worker`` left or turned not ready: whatever the policy recorded of it is stale."""


class RoundRobinPolicy(BaseRoutingPolicy):
    """Each kind cycles through its ready workers in turn."""

    def __init__(self) -> None:
        self._turns: dict[WorkerKind, itertools.count] = {}

    def _turn(self, kind: WorkerKind) -> int:
        return next(self._turns.setdefault(kind, itertools.count()))

    def choose(
        self, kind: WorkerKind, candidates: Sequence[Worker], prompt: TokenizedPrompt | None = None
    ) -> Worker:
        assert candidates, "choose needs a candidate"
        return candidates[self._turn(kind) % len(candidates)]


class LeastLoadPolicy(RoundRobinPolicy):
    """The worker with the fewest requests in flight from this router; ties go round-robin."""

    def choose(
        self, kind: WorkerKind, candidates: Sequence[Worker], prompt: TokenizedPrompt | None = None
    ) -> Worker:
        assert candidates, "choose needs a candidate"
        least = min(w.num_in_flight for w in candidates)
        tied = [w for w in candidates if w.num_in_flight == least]
        return tied[self._turn(kind) % len(tied)]


class CacheAwarePolicy(LeastLoadPolicy):
    """Prefill: the worker holding the longest recorded prefix of the prompt, unless it is more
    than ``max_imbalance`` requests busier than the least loaded (then: least load). Other
    kinds: least load."""

    def __init__(self, max_imbalance: int) -> None:
        super().__init__()
        self.max_imbalance = max_imbalance
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}  # address -> blocks, LRU first

    def forget(self, worker: Worker) -> None:
        self._blocks.pop(worker.address, None)

    def matched_blocks(self, worker: Worker, blocks: Sequence[bytes]) -> int:
        """How many leading ``blocks`` the record of ``worker`` holds."""
        held = self._blocks.get(worker.address, {})
        return next((i for i, b in enumerate(blocks) if b not in held), len(blocks))

    def choose(
        self, kind: WorkerKind, candidates: Sequence[Worker], prompt: TokenizedPrompt | None = None
    ) -> Worker:
        if kind is not WorkerKind.PREFILL or prompt is None:
            return super().choose(kind, candidates)
        blocks = page_keys(prompt.token_ids, prompt.spans, CACHE_BLOCK_TOKENS)
        least = min(w.num_in_flight for w in candidates)
        fit = [w for w in candidates if w.num_in_flight <= least + self.max_imbalance]
        matched = {w.address: self.matched_blocks(w, blocks) for w in fit}
        best = max(matched.values())
        if best:  # the longest match; among equals the least loaded, then configured order
            chosen = min(
                (w for w in fit if matched[w.address] == best), key=lambda w: w.num_in_flight
            )
        else:
            chosen = super().choose(kind, candidates)
        held = self._blocks.setdefault(chosen.address, OrderedDict())
        for block in reversed(blocks):  # deepest first: a prefix outlives its continuations
            held[block] = None
            held.move_to_end(block)
        while len(held) > MAX_BLOCKS_PER_WORKER:
            held.popitem(last=False)
        return chosen


def make_policy(name: PolicyName, max_imbalance: int = 0) -> BaseRoutingPolicy:
    if name is PolicyName.CACHE_AWARE:
        return CacheAwarePolicy(max_imbalance)
    return {PolicyName.ROUND_ROBIN: RoundRobinPolicy, PolicyName.LEAST_LOAD: LeastLoadPolicy}[
        name
    ]()
