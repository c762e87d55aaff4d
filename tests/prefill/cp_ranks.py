"""Prefill rank groups of real processes (gloo on CPU) driven by plans built here.

``RecordingStep`` (``tests.prefill.cp_ranks:RecordingStep``) is the production step that
also returns the logits each rank sampled from, so a test can compare C ranks with one,
and injects the faults a payload's request id asks for: ``raise-r<R>-l<L>`` raises on
rank R in layer L's MLP, ``stop-r<R>`` SIGSTOPs rank R mid-pass. The test process plays
decode (a shm KV pool) and the vision encoder (it writes image rows into every rank's
buffer over shm).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Sequence

import msgspec
import torch

from services.common.destinations import EmbeddingDestination
from services.common.ranks.config import RankGroupConfig, StepSpec
from services.common.ranks.group import RankGroup
from services.common.ranks.step import RankContext
from services.engine.kv_cache import KVPageManager, KVPool
from services.prefill.messages import (
    SHARDED,
    Describe,
    PassSegment,
    RankDescription,
    RankPlan,
    RankRequest,
    RankResult,
)
from services.prefill.rank_step import PrefillRankInit, PrefillRankStep
from services.transfer.embeddings_shm import ShmEmbeddingSender
from services.transfer.shm_backend import ShmKVReceiver
from tests.conftest import REPO, TINY_MODEL_DIR, environ

TARGET = "tests.prefill.cp_ranks:RecordingStep"
PAGE_SIZE = 4  # small pages: prompts span many (the session pipeline uses it too)
START_TIMEOUT_S = 180.0  # C torch imports and model loads at once on a loaded 2-core machine
_FAULT = re.compile(r"(raise|stop)-r(\d+)(?:-l(\d+))?")


class RecordingResult(RankResult, frozen=True):
    logits: dict[
        str, list[float]
    ] = {}  # request_id -> the first-token logits this rank sampled from
    last_error: str = ""  # the agreed error of the last failed step, as this rank heard it
    num_free_pages: int = 0  # this rank's free local KV pages after the step
    cached_keys: frozenset[bytes] = frozenset()  # the prefix-cache keys it holds after the step
    host_keys: frozenset[bytes] = frozenset()  # those in its host tier
    drain_len: int = 0  # a fake rank-local drain queue, different on every rank (never in a plan)
    num_experts_held: int = 0  # experts of the first MoE layer this rank holds (0: dense)


class RecordingStep(PrefillRankStep):
    result_type = RecordingResult

    def __init__(self, ctx: RankContext, init: PrefillRankInit) -> None:
        super().__init__(ctx, init)
        self._logits: dict[str, list[float]] = {}
        self._faults: list[tuple[str, int]] = []
        self._last_error = ""
        self._drain_rng, self._drain_len = random.Random(ctx.rank), 3 * ctx.rank
        sample = self.worker._sample

        def recording_sample(requests, logits, owners):
            for row, i in enumerate(owners):
                self._logits[requests[i].request_id] = logits[row].tolist()
            return sample(requests, logits, owners)

        self.worker._sample = recording_sample  # type: ignore[method-assign]
        for layer_id, layer in enumerate(self.worker.runner.model.model.layers):
            layer.mlp.forward = self._faulty(layer_id, layer.mlp.forward)

    def _faulty(self, layer_id: int, forward):
        def maybe_fail(x):
            for kind, layer in self._faults:
                if kind == "raise" and layer == layer_id:
                    raise RuntimeError(f"injected failure in layer {layer_id}")
                if kind == "stop" and layer_id == 1:
                    os.kill(os.getpid(), signal.SIGSTOP)
            return forward(x)

        return maybe_fail

    def execute(self, step: int, payload) -> RankResult:
        self._logits = {}
        self._faults = []
        if isinstance(payload, RankPlan):
            for request in payload.requests:
                match = _FAULT.fullmatch(request.request_id.split(":")[0])
                if match and int(match[2]) == self.ctx.rank:
                    self._faults.append((match[1], int(match[3] or 0)))
        result = super().execute(step, payload)
        return RecordingResult(
            **msgspec.structs.asdict(result),
            logits=self._logits,
            last_error=self._last_error,
            num_free_pages=self.worker.runner.page_manager.num_free_pages,
            cached_keys=self.worker.prefix.keys(),
            host_keys=self.worker.prefix.host_keys(),
            drain_len=self._drain(),
            num_experts_held=self._num_experts_held(),
        )

    def _num_experts_held(self) -> int:
        for layer in self.worker.runner.model.model.layers:
            shard = getattr(layer.mlp, "expert_shard", None)
            if shard is not None:
                return shard.size
        return 0

    def _drain(self) -> int:
        self._drain_len = max(0, self._drain_len + self._drain_rng.choice((-1, 0, 1, 2)))
        return self._drain_len

    def on_failed(self, step: int, error: str) -> None:
        self._last_error = error
        super().on_failed(step, error)


def rank_init(**overrides) -> PrefillRankInit:
    values = dict(
        model=str(TINY_MODEL_DIR),
        dtype=None,
        num_pages=512,
        page_size=PAGE_SIZE,
        embedding_rows=1024,
        attention_backend="torch",
        transfer_backend="shm",
        kv_backend="shm",
        transfer_hostname="127.0.0.1",
    )
    values.update(overrides)
    return PrefillRankInit(**values)


def group_config(num_ranks: int, **overrides) -> RankGroupConfig:
    values = dict(
        name=f"prefill-cp{num_ranks}",
        devices=("cpu",) * num_ranks,
        step_timeout_s=60.0,
        start_timeout_s=START_TIMEOUT_S,
        collective_timeout_s=20.0,
        heartbeat_s=0.5,
        leader_timeout_s=20.0,
        restart_backoff_s=0.1,
        stop_grace_s=3.0,
        internal_token=os.environ["STAGESERVE_INTERNAL_TOKEN"],  # tests.conftest sets it
    )
    values.update(overrides)
    return RankGroupConfig(**values)


def rank_env() -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


class Ranks:
    """A started group, its ranks' descriptions, and step helpers."""

    def __init__(self, group: RankGroup, readiness: list[bool]) -> None:
        self.group, self.readiness = group, readiness
        self.descriptions: list[RankDescription] = []

    async def describe(self) -> list[RankDescription]:
        results = await self.group.step(Describe())
        self.descriptions = [r.description for r in results]
        return self.descriptions

    async def run(self, plan: RankPlan, timeout_s: float | None = None) -> list[RecordingResult]:
        return await self.group.step(plan, timeout_s)


@contextlib.asynccontextmanager
async def started_ranks(num_ranks: int, init: PrefillRankInit | None = None, **overrides):
    """A group of ``num_ranks`` CPU ranks (``devices=`` in ``overrides`` names others)."""
    readiness: list[bool] = []
    with environ(rank_env()):
        group = RankGroup(
            group_config(num_ranks, **overrides),
            StepSpec(TARGET, RecordingResult, init or rank_init()),
            on_ready_change=readiness.append,
        )
        await group.start()
    ranks = Ranks(group, readiness)
    try:
        await ranks.describe()
        yield ranks
    finally:
        await group.aclose()


class DecodePool:
    """Decode's shm KV pool: pages handed out shuffled, so position order matters."""

    def __init__(self, model_config, num_pages: int = 1024) -> None:
        text = model_config.text
        self.pool = KVPool(
            text.num_hidden_layers,
            num_pages,
            PAGE_SIZE,
            text.num_key_value_heads,
            text.head_dim,
            torch.float32,
            "cpu",
        )
        self.pages = KVPageManager(num_pages, PAGE_SIZE)
        self.receiver = ShmKVReceiver()
        self.receiver.register(self.pool)
        self._rng = random.Random(0)

    def reserve(self, request_id: str, num_tokens: int, extra_pages: int = 0):
        pages = self.pages.allocate(-(-num_tokens // PAGE_SIZE) + extra_pages)
        self._rng.shuffle(pages)
        for layer in range(self.pool.num_layers):  # zero, so a page nobody wrote shows
            for part in (self.pool.k_cache, self.pool.v_cache):
                part[layer][pages] = 0
        return self.receiver.destination(request_id, pages)

    def kv(self, dst, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(num_tokens)
        slots = (
            torch.tensor(dst.page_ids)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        )
        k = torch.stack([self.pool.k_slots(layer)[slots] for layer in range(self.pool.num_layers)])
        v = torch.stack([self.pool.v_slots(layer)[slots] for layer in range(self.pool.num_layers)])
        return k, v

    def free(self, dst) -> None:
        self.pages.free(list(dst.page_ids))

    def close(self) -> None:
        self.receiver.close()


def write_rows(
    descriptions: Sequence[RankDescription], request_id: str, row_start: int, rows: torch.Tensor
) -> None:
    """Play the encoder: ``rows`` into rows ``[row_start, ...)`` of every rank's buffer."""
    sender = ShmEmbeddingSender()
    try:
        for desc in descriptions:
            whole: EmbeddingDestination = desc.embeddings
            window = msgspec.structs.replace(
                whole,
                base_address=whole.base_address + row_start * whole.row_stride_bytes,
                num_rows=rows.shape[0],
            )
            sender.send_rows(request_id, rows.contiguous(), window, 0, time.monotonic() + 10)
    finally:
        sender.close()


def plan_of(
    plan_id: int,
    requests: Sequence[RankRequest],
    *,
    block_tokens: int = 1,
    chunk_tokens: int = 0,
    solo_rank: int = SHARDED,
) -> RankPlan:
    """One pass with every request, or (``chunk_tokens``, one request) its chunks as passes."""
    if chunk_tokens:
        [request] = requests
        n = request.num_tokens
        passes = tuple(
            (PassSegment(0, s, min(s + chunk_tokens, n)),) for s in range(0, n, chunk_tokens)
        )
    else:
        passes = (tuple(PassSegment(i, 0, r.num_tokens) for i, r in enumerate(requests)),)
    return RankPlan(plan_id, tuple(requests), passes, solo_rank, block_tokens)
