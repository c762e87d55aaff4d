"""The prefill leader's plans on its rank group: what the ranks are handed, the step, and what
the scheduler makes of the result.

``PlanRunner.payload`` turns the scheduler's plan into the ranks' (``RankPlan``: sharded over
the C CP ranks or run by one, what each reads from and keeps in the prefix cache). ``run``
steps it on every rank, merges every rank's result and hands it to the scheduler. A step that
fails fails its requests (``fail``), and what its ranks kept of it is forgotten; a step that
read the shared KV store is run again without it instead. The leader keeps one plan in
flight and resolves the outcomes returned here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from services.common.errors import StageServeError
from services.engine.config import ModelConfig
from services.prefill import metrics
from services.prefill.messages import RankPlan
from services.prefill.planning import CpPolicy, merge_results, rank_plan
from services.prefill.request import PrefillOutput, PrefillPlan, RequestOutcome
from services.prefill.scheduler import PrefillScheduler
from services.prefill.spans import forward_spans, transfer_spans

logger = logging.getLogger(__name__)


class Ranks(Protocol):
    """What the leader needs of its rank group (``RankGroup`` is one)."""

    num_ranks: int

    async def step(self, payload: msgspec.Struct, timeout_s: float | None = None) -> list: ...


class PlanRunner:
    """Steps the plans of ``scheduler`` on ``ranks`` (C CP ranks of ``tp_size`` TP ranks each).

    ``is_stopping``: whether the leader is shutting down (a failed step is then not retried)."""

    def __init__(
        self,
        scheduler: PrefillScheduler,
        ranks: Ranks,
        model_config: ModelConfig,
        cp: CpPolicy,
        tp_size: int,
        step_timeout_s: float,
        clock: Callable[[], float],
        is_stopping: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self.ranks = ranks
        self.model_config = model_config
        self.cp = cp
        self.tp_size = tp_size
        self.step_timeout_s = step_timeout_s
        self._clock = clock
        self._is_stopping = is_stopping

    @property
    def cp_size(self) -> int:
        """The CP ranks plans are made for (each a TP group of ``tp_size`` ranks)."""
        return self.ranks.num_ranks // self.tp_size

    def payload(self, plan: PrefillPlan) -> RankPlan:
        """What every rank is handed for ``plan``."""
        metrics.BATCH_SIZE.observe(len(plan.requests))
        metrics.BATCH_TOKENS.observe(plan.num_tokens)
        prefix = self.scheduler.prefix
        payload = rank_plan(plan, self.cp, self.cp_size, self._clock(), prefix)
        if prefix is not None:
            metrics.record_prefix_plan(prefix, payload, plan.num_tokens)
        return payload

    async def run(self, plan: PrefillPlan, payload: RankPlan) -> list[RequestOutcome]:
        """One step on every rank; the outcomes the scheduler made of it. A step that fails
        fails here (``fail``); a cancelled one is the caller's to fail."""
        try:
            output = await self._step(plan, payload)
            return self.scheduler.update_from_output(plan, output)
        except StageServeError as exc:
            logger.error("prefill batch %d failed: %s", plan.plan_id, exc.message)
            return self.fail(plan, payload, exc)
        except Exception as exc:  # a bug merging the results: fail the batch, keep serving
            logger.exception("prefill batch %d failed", plan.plan_id)
            error = StageServeError(f"prefill batch failed: internal error ({type(exc).__name__})")
            return self.fail(plan, payload, error)

    def fail(
        self, plan: PrefillPlan, payload: RankPlan, error: StageServeError
    ) -> list[RequestOutcome]:
        """Every request of the failed step fails (a step that read the shared KV store is
        run again without it instead); what its ranks kept of it is dropped."""
        if self.scheduler.prefix is not None:
            stored = [k for r in payload.requests for k in r.store_keys]
            moved = [k for m in payload.moves for k in (*m.spill, *m.load, *m.fetch)]
            self.scheduler.prefix.forget([*stored, *moved], payload.ranks(self.cp_size))
        if any(m.fetch for m in payload.moves) and not self._is_stopping():
            logger.warning(
                "a batch that read the KV store failed (%s): run again without", error.message
            )
            metrics.PREFIX_CACHE_STORE_FAILURES.labels("fetch").inc()
            self.scheduler.retry_without_store(plan)
            return []
        return self.scheduler.fail_plan(plan, error)

    async def _step(self, plan: PrefillPlan, payload: RankPlan) -> PrefillOutput:
        spans = forward_spans(plan, payload, self.cp_size)
        try:
            results = await self.ranks.step(payload, self.step_timeout_s)
            output = merge_results(plan, payload, results, self.model_config)
        finally:
            end_ns = time.time_ns()
            for span in spans:
                span.end(end_ns)
        transfer_spans(plan, output, end_ns)
        metrics.FORWARD_S.observe(output.forward_s)
        for outcome in output.outcomes:
            if outcome.is_ok:
                metrics.KV_BYTES.inc(outcome.num_kv_bytes)
                metrics.KV_TRANSFER_S.observe(outcome.kv_transfer_s)
        return output
