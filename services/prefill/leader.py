"""Prefill leader: admits requests, drives Encode calls, hands plans to the rank group, answers
callers.

Runs on the event loop and touches no torch device: every decision (admission, batches,
chunks, whether a plan is sharded over the C ranks or run by one) is made here from the
leader's own state and travels to every rank in the plan (``RankPlan``). One plan is in
flight at a time (``plan_runner.py``): ``RankGroup.step`` runs it on every rank and returns
every rank's result (or the one agreed error) to the loop. Each caller awaits its request's
future until the request's deadline; a caller that gives up aborts its request, whose
resources are then released wherever it is (a running request's write was decided with its
plan and still lands, inside decode's quarantine). ``progress`` ticks when a plan is launched
and done.
After every (re-)formation of the rank group the leader asks each rank where it receives
image rows (``Describe``) before it plans again; a re-formed group lost the rows of the
requests that were encoding, which fail. On SIGTERM ``drain`` refuses new requests
(UNAVAILABLE) while the ones in flight go on, up to its budget; ``stop`` fails the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from services.common.errors import (
    AbortedError,
    DeadlineExceededError,
    StageServeError,
    UnavailableError,
)
from services.common.prefix_keys import page_keys
from services.common.progress import ProgressWatchdog
from services.engine.config import ModelConfig
from services.prefill import metrics
from services.prefill.encoding import Encoder, encode_entry
from services.prefill.messages import Describe, RankDescription, RankPlan, RankResult
from services.prefill.plan_runner import PlanRunner, Ranks
from services.prefill.planning import CpPolicy
from services.prefill.prefix_cache import CacheAsk
from services.prefill.request import (
    PrefillInput,
    PrefillPlan,
    PrefillStatus,
    RequestOutcome,
)
from services.prefill.scheduler import PrefillScheduler, SchedEntry
from services.prefill.store_tier import StoreLookup
from services.prefill.validation import (
    PromptLimits,
    prompt_destinations,
    validate_prompt,
    validate_prompt_embeds,
)

logger = logging.getLogger(__name__)
RETRY_S = 0.5  # a pump that raised is tried again after this long


@dataclass(frozen=True)
class LeaderOptions:
    cp: CpPolicy
    step_timeout_s: float = 60.0  # a plan's deadline on the ranks
    watchdog_s: float = 30.0
    tp_size: int = 1  # the ranks are num_ranks / tp_size CP ranks, each a TP group of tp_size


class PrefillLeader:
    def __init__(
        self,
        scheduler: PrefillScheduler,
        ranks: Ranks,
        model_config: ModelConfig,
        encoder: Encoder | None,
        options: LeaderOptions,
        clock: Callable[[], float] = time.monotonic,
        store: StoreLookup | None = None,
    ) -> None:
        """``store``: asks the KV store shared with other prefill workers what it holds."""
        self.scheduler = scheduler
        self.store = store
        self.ranks = ranks
        self.encoder = encoder
        self.options = options
        self.model_config = model_config
        self.limits = PromptLimits.from_config(model_config)
        self.descriptions: list[RankDescription] = []  # empty while the group (re-)forms
        self.on_serving: Callable[[bool], None] = lambda is_serving: (
            None
        )  # health, set by the caller
        self._clock = clock
        self._futures: dict[str, asyncio.Future[RequestOutcome]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None  # the next deadline's pump
        self._is_stopping = False
        self._is_draining = False
        self._idle = asyncio.Event()  # set when the last request in flight leaves
        self.plans = PlanRunner(
            scheduler,
            ranks,
            model_config,
            options.cp,
            options.tp_size,
            options.step_timeout_s,
            clock,
            lambda: self._is_stopping,
        )
        # Progress: a plan launched, a plan done. Run by the caller (``progress.start``).
        self.progress = ProgressWatchdog(
            "prefill",
            options.watchdog_s,
            lambda: scheduler.has_worker_work,
            may_serve=lambda: bool(self.descriptions),  # the group formed and described itself
            clock=clock,
            stalled_gauge=metrics.STALLED,
        )

    async def start(self) -> None:
        """Describe the ranks (the group has formed); from then on every event pumps."""
        self._loop = asyncio.get_running_loop()
        await self._describe()

    def on_group_ready(self, is_ready: bool) -> None:
        """The rank group's readiness changed (from its thread): serve only after a fresh
        Describe."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._group_ready_changed, is_ready)

    def _group_ready_changed(self, is_ready: bool) -> None:
        if self._is_stopping:
            return
        if not is_ready:
            self.descriptions = []
            self.on_serving(False)
            if self.scheduler.prefix is not None:  # the ranks' caches are gone with them
                self.scheduler.prefix.clear()
            error = UnavailableError(
                "the prefill rank group re-formed; the image rows it held are gone"
            )
            self._resolve(self.scheduler.fail_row_holders(error))
            return
        self._spawn(self._redescribe())

    async def _redescribe(self) -> None:
        try:
            await self._describe()
        except StageServeError as exc:  # the new group failed again: its next formation retries
            logger.error("describing the re-formed prefill ranks failed: %s", exc.message)

    async def _describe(self) -> None:
        results: list[RankResult] = await self.ranks.step(Describe(), self.options.step_timeout_s)
        self.descriptions = [r.description for r in results if r.description is not None]
        assert len(self.descriptions) == self.ranks.num_ranks, "every rank describes itself"
        if self.scheduler.prefix is not None:  # the ranks' caches start empty after Describe
            self.scheduler.prefix.clear(
                min(d.num_host_pages for d in self.descriptions),
                self.store is not None and all(d.has_store for d in self.descriptions),
            )
        self.on_serving(True)
        self._pump()

    async def drain(self, budget_s: float) -> None:
        """Refuse new requests from now on (UNAVAILABLE) and give the ones in flight
        ``budget_s`` to end; ``stop`` fails those left."""
        self._is_draining = True
        logger.info("draining: %d requests in flight, %g s to finish", len(self._futures), budget_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(budget_s):
                while self._futures:
                    self._idle.clear()
                    await self._idle.wait()
        if self._futures:
            logger.warning("drain budget of %g s spent: failing %d", budget_s, len(self._futures))

    async def stop(self) -> None:
        """Fail every live request (UNAVAILABLE) and stop the tasks; the caller stops the group."""
        self._is_stopping = True
        self.progress.stop()
        if self._timer is not None:
            self._timer.cancel()
        for request_id, future in list(self._futures.items()):
            if not future.done():
                future.set_exception(
                    UnavailableError(f"prefill worker shut down before {request_id} finished")
                )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- the caller's side -----------------------------------------------------------
    async def prefill(self, request: PrefillInput, images: dict[str, bytes]) -> RequestOutcome:
        """Validate, queue and wait for ``request``; raises its error (``StageServeError``)."""
        start, label = self._clock(), "internal"
        try:
            outcome = await self._prefill(request, images)
            label = "ok"
            metrics.LATENCY_S.observe(self._clock() - start)
            return outcome
        except StageServeError as exc:
            label = metrics.outcome_label(exc)
            raise
        except asyncio.CancelledError:
            label = "cancelled"
            raise
        finally:
            metrics.REQUESTS.labels(label).inc()

    async def _prefill(self, request: PrefillInput, images: dict[str, bytes]) -> RequestOutcome:
        if self._is_stopping or self._loop is None:
            raise UnavailableError("prefill worker is not running")
        if self._is_draining:
            raise UnavailableError("this prefill worker is shutting down and takes no new requests")
        request = self._validated(request, images)
        entry = self.scheduler.add(request, images)
        prefix = self.scheduler.prefix
        if prefix is not None and prefix.has_store and self.store is not None:
            entry.is_store_pending = True  # planned once the store answered (bounded)
            self._spawn(self._ask_store(entry))
        future = self._loop.create_future()
        self._futures[request.request_id] = future
        try:
            self._pump()
            return await self._wait(request, future)
        finally:
            self._futures.pop(request.request_id, None)
            if not self._futures:
                self._idle.set()
            if not future.done():  # the caller gave up (deadline, cancellation) or an error
                gone = AbortedError(f"the caller of {request.request_id} is gone")
                self._abort(request.request_id, gone)

    def _validated(self, request: PrefillInput, images: dict[str, bytes]) -> PrefillInput:
        validate_prompt(request.token_ids, request.spans, images, request.params, self.limits)
        validate_prompt_embeds(
            request.prompt_embeds,
            request.embeds_dtype,
            request.num_tokens,
            len(request.spans),
            self.limits,
        )
        if request.spans and self.encoder is None:
            raise UnavailableError("this prefill worker has no vision encoder (--encoder-address)")
        if not self.descriptions:
            raise UnavailableError("the prefill rank group is re-forming")
        group = self.descriptions[: self.options.tp_size]  # each TP rank's heads
        kv_dst, *kv_tp_dsts = prompt_destinations(
            (request.kv_dst, *request.kv_tp_dsts),
            [d.kv_layout for d in group],
            request.num_tokens,
            group[0].kv_backend,
        )
        kind = PrefillScheduler.kind_of(request.num_image_tokens, bool(request.prompt_embeds))
        keys: tuple[bytes, ...] = ()
        if self.scheduler.prefix is not None:
            keys = tuple(page_keys(request.token_ids, request.spans, self.scheduler.page_size))
        return msgspec.structs.replace(
            request, kv_dst=kv_dst, kv_tp_dsts=tuple(kv_tp_dsts), kind=kind, page_keys=keys
        )

    async def _wait(
        self, request: PrefillInput, future: asyncio.Future[RequestOutcome]
    ) -> RequestOutcome:
        request_id = request.request_id
        try:
            async with asyncio.timeout(max(request.deadline_mono - self._clock(), 0.0)):
                outcome = await asyncio.shield(future)
        except TimeoutError:
            raise DeadlineExceededError(f"prefill of {request_id} passed its deadline") from None
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def _abort(self, request_id: str, error: StageServeError) -> None:
        if not self._is_stopping:
            self.scheduler.abort(request_id, error)
            self._pump()

    def _resolve(self, outcomes: Sequence[RequestOutcome]) -> None:
        for outcome in outcomes:
            future = self._futures.get(outcome.request_id)
            if future is not None and not future.done():
                future.set_result(outcome)

    # --- driving the scheduler ---------------------------------------------------------
    def _pump(self) -> None:
        """Expire, admit (start Encodes), and launch a plan if none is in flight; then sleep
        until the scheduler's next deadline (or the next event: a call, an Encode, a plan)."""
        if self._is_stopping:
            return
        self._resolve(self.scheduler.expire())
        if self.descriptions:  # rows and plans need a formed, described group
            for entry in self.scheduler.admit():
                self._spawn(self._encode(entry))
            plan = self.scheduler.schedule()
            if plan is not None:
                self._launch(plan)
        metrics.EMBEDDING_ROWS_USED.set(self.scheduler.num_rows_used)
        metrics.SATURATION.set(self.scheduler.saturation)
        metrics.QUEUED.set(
            sum(
                self.scheduler.num_in(s)
                for s in (PrefillStatus.QUEUED, PrefillStatus.READY, PrefillStatus.ENCODING)
            )
        )
        self._arm(self.scheduler.next_wake())

    def _arm(self, wake_at: float | None) -> None:
        """Pump at ``wake_at`` (the leader's clock), replacing the timer armed before."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if wake_at is not None and self._loop is not None and not self._is_stopping:
            delay_s = max(wake_at - self._clock(), 0.0)
            self._timer = self._loop.call_later(delay_s, self._timed_pump)

    def _timed_pump(self) -> None:
        """A deadline's pump; one that raises is logged and tried again (expiry and quarantine
        release need it), as every later event would also try."""
        self._timer = None
        try:
            self._pump()
        except Exception:
            logger.exception("prefill scheduler pump failed")
            self._arm(self._clock() + RETRY_S)

    def _spawn(self, coro: object) -> None:
        assert self._loop is not None
        task = self._loop.create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _launch(self, plan: PrefillPlan) -> None:
        self.progress.tick()
        self._spawn(self._run_plan(plan, self.plans.payload(plan)))

    async def _run_plan(self, plan: PrefillPlan, payload: RankPlan) -> None:
        """One step on every rank; the scheduler hears the outcome on every path."""
        outcomes: list[RequestOutcome] = []
        try:
            outcomes = await self.plans.run(plan, payload)
        except asyncio.CancelledError:
            error = UnavailableError("prefill worker shut down mid-batch")
            outcomes = self.plans.fail(plan, payload, error)
            raise
        finally:
            self.progress.tick()
            self._resolve(outcomes)
            self._pump()

    async def _ask_store(self, entry: SchedEntry) -> None:
        assert self.store is not None
        ask = CacheAsk.of(entry.input)
        limit = (ask.num_tokens - 1) // self.scheduler.page_size if ask.can_read else 0
        if limit and not entry.skips_store:
            entry.in_store = await self.store.leading(entry.input.page_keys[:limit])
        entry.is_store_pending = False
        self._pump()

    async def _encode(self, entry: SchedEntry) -> None:
        await encode_entry(self.encoder, entry, self.descriptions, self._clock, self._encoded)

    def _encoded(
        self, request_id: str, error: StageServeError | None, num_cached: int, may_write: bool
    ) -> None:
        """An Encode call ended (``encode_entry``): the scheduler frees or quarantines its rows."""
        outcome = self.scheduler.finish_encoding(request_id, error, num_cached, may_write)
        if outcome is not None:
            self._resolve([outcome])
        self._pump()
