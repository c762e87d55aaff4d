"""A decode rank: its KV pool and receiver, its scheduler and its step loop, one step per command
batch.

``DecodeRank.execute(commands)`` is one iteration of the rank's loop, in this order:
  1. apply the commands in arrival order (Reserve, Start, Abort). An abort takes effect at
     once: the tokens a step not read yet made for the request are dropped when read, so
     the caller gets exactly the tokens it had, as from a synchronous loop
  2. expire overdue reservations, return quarantined pages that are due
  3. plan step N+1 and launch it on the device
  4. read step N (overlapped; synchronous: step N+1 itself) and apply the stop rules
  5. report: replies, the tokens read, finished and expired requests, the load
``DecodeRankStep`` (``rank_step.py``) is the rank process's ``FreeRankStep``: it builds a
``DecodeRank`` on the rank's device, and the rank's own loop (``common/ranks/free_loop.py``) runs
``execute`` with the commands posted since its previous step, again at once while the
rank ``has_work`` (so the device runs step N+1 while step N's report travels), and when
``seconds_until_due`` runs out (a reservation's expiry, quarantined pages due back).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import (
    DeadlineExceededError,
    ErrorRecord,
    InvalidRequestError,
    StageServeError,
)
from services.common.gpu_share import GpuShare
from services.common.kv_transfer import TransferSpec, check_kv_backend
from services.common.types import SamplingParams, TokenLogprob
from services.decode.batch import DecodeBatchRunner, StepLoop
from services.decode.kv_manager import KVReservationManager
from services.decode.messages import (
    AbortCommand,
    AbortReply,
    Command,
    Finished,
    RankCommands,
    RankInit,
    RankLoad,
    RankReport,
    Reply,
    ReserveCommand,
    ReserveReply,
    StartCommand,
    StartReply,
)
from services.decode.scheduler import DecodeRequest, DecodeScheduler, check_prompt_len
from services.decode.tp_mirror import StepMirror
from services.engine.cuda_graph import graph_batch_sizes
from services.engine.grammar import GrammarCache
from services.engine.loader import load_model
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.sampler import Sampler
from services.transfer import BaseKVReceiver, create_kv_receiver
from services.transfer.base import Clock

logger = logging.getLogger(__name__)


class StepRows(Protocol):
    """How a DP-attention group agrees on each step's rows per rank (``dp_attention.py``)."""

    def rows(self, mine: int) -> int: ...


@dataclass
class _StepOutput:
    tokens: list[tuple[str, int]]
    finished: list[Finished]
    num_rows: int = 0
    step_s: float = 0.0
    prefill_wait_s: float = 0.0
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # of requests that asked


class DecodeRank:
    """One rank's requests on one model runner; not thread-safe (the rank's step thread runs it)."""

    def __init__(
        self,
        scheduler: DecodeScheduler,
        loop: StepLoop,
        receiver: BaseKVReceiver,
        clock: Clock = time.monotonic,
        gpu_share: GpuShare | None = None,
        prefill_first_s: float = 0.0,
    ) -> None:
        """``gpu_share``: where a prefill on the same GPU marks its forwards; a step about to
        launch waits for them at most ``prefill_first_s``."""
        # a tensor-parallel rank's followers' pools (session id, layout), TP rank order: each
        # reservation's pages are theirs too (build_tp_rank)
        self.tp_peers: tuple[tuple[str, KvPoolLayout], ...] = ()
        # DP attention: how the group agrees on each step's rows (dp_attention.py)
        self.dp: StepRows | None = None
        self.scheduler = scheduler
        self.loop = loop
        self.receiver = receiver
        self.gpu_share = gpu_share
        self.prefill_first_s = prefill_first_s
        self.vocab_size = loop.batch.vocab_size
        self._clock = clock
        self._next_step = 0
        self._last_read_s = 0.0

    def execute(self, payload: RankCommands) -> RankReport:
        finished: list[Finished] = []
        replies = tuple(self._apply(command, finished) for command in payload.commands)
        expired = self.scheduler.expire(self._clock())
        self.scheduler.kv.release_quarantined()
        output = self._step()
        return self._report(replies, output, finished + output.finished, expired)

    @property
    def has_work(self) -> bool:
        """Requests generating, or a launched step not read yet: step again at once."""
        return self.scheduler.has_work or self.loop.has_unread

    def seconds_until_due(self) -> float:
        """Until a reservation expires or quarantined pages are due back (inf: neither)."""
        expiry_s = self.scheduler.next_expiry_mono() - self._clock()
        return min(expiry_s, self.scheduler.kv.seconds_to_release())

    def reset(self) -> None:
        """After a failed step: every live request ends (the leader fails them), the loop
        restarts."""
        self.scheduler.abort_all()
        self.loop.reset()
        self.scheduler.drop_unread(self.loop.last_launched_step)

    def warmup(self) -> None:
        """One DECODE forward and sampling of a scratch request (kernels compiled, buffers
        touched)."""
        request = DecodeRequest(
            "warmup", (0,), SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True), 0
        )
        self.scheduler.add(request)
        self.scheduler.start("warmup", 0)
        while self.scheduler.has_work or self.loop.has_unread:
            self._step()
        assert "warmup" not in self.scheduler

    def _apply(self, command: Command, finished: list[Finished]) -> Reply:
        if isinstance(command, ReserveCommand):
            return self._reserve(command)
        if isinstance(command, StartCommand):
            return self._start(command, finished)
        return self._abort(command)

    def _reserve(self, command: ReserveCommand) -> ReserveReply:
        request = DecodeRequest(
            request_id=command.request_id,
            prompt_ids=command.prompt_ids,
            params=command.params,
            rope_delta=command.rope_delta,
            deadline_mono=self._clock() + command.lifetime_s,
            kv_written_proof=command.kv_written_proof,
        )
        try:
            self._validate(request, command.lifetime_s)
            pages = self.scheduler.add(request)
        except StageServeError as exc:
            return ReserveReply(command.request_id, error=ErrorRecord.of(exc))
        prompt_pages = tuple(pages[: self.scheduler.kv.num_pages_for(len(request.prompt_ids))])
        return ReserveReply(
            command.request_id,
            destination=self.receiver.destination(request.request_id, prompt_pages),
            tp_destinations=tuple(
                KvDestination(
                    self.receiver.backend, session, request.request_id, layout, prompt_pages
                )
                for session, layout in self.tp_peers
            ),
        )

    def _start(self, command: StartCommand, finished: list[Finished]) -> StartReply:
        try:
            if not 0 <= command.first_token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"first_token_id must be in [0, {self.vocab_size})", param="first_token_id"
                )
            self.scheduler.check_kv_written(command.request_id, command.kv_written_proof)
            params = self.scheduler.params(command.request_id)
            if params is not None and params.grammar is not None:
                self.loop.batch.grammar_matcher(params.grammar, command.first_token_id)
            done = self.scheduler.start(command.request_id, command.first_token_id)
        except StageServeError as exc:
            return StartReply(command.request_id, error=ErrorRecord.of(exc))
        if done is not None:
            finished.append(done)
        return StartReply(command.request_id)

    def _abort(self, command: AbortCommand) -> AbortReply:
        is_found = self.scheduler.abort(command.request_id, is_kv_written=command.is_kv_written)
        return AbortReply(command.request_id, is_found)

    def _step(self) -> _StepOutput:
        plan = self.scheduler.schedule(self._next_step) if self.scheduler.has_work else None
        waited: list[float] = []  # (seconds waited, when the wait ended) once waited
        if plan is not None:
            self._next_step += 1
        if self.dp is not None:  # every rank of the group agrees on the step's rows
            runner = self.loop.batch.runner
            rows = self.dp.rows(plan.num_rows if plan is not None else 0)
            runner.set_dp_rows(rows)
            if plan is None and rows:  # the others' forward, in the same graph size or eager
                runner.idle_decode()  # all padding rows, or this rank's MLPs join with none

        def wait_for_prefill() -> None:
            # prefill first: its forward runs on the GPU alone. Called with the step's inputs
            # staged and its attention planned, so the GPU gets the step right after the wait
            assert self.gpu_share is not None
            waited.extend((self.gpu_share.wait_for_prefill(self.prefill_first_s), self._clock()))

        done = self.loop.step(plan, wait_for_prefill if self.gpu_share is not None else None)
        waited_s, wait_end = waited or (0.0, 0.0)
        if done is None:
            return _StepOutput([], [], prefill_wait_s=waited_s)
        launched, token_ids = done
        tokens, finished = self.scheduler.update_from_output(launched.plan, token_ids)
        logprobs = self.loop.batch.read_logprobs(launched)
        now = self._clock()
        start = max(self._last_read_s, launched.launch_s)
        step_s = now - start - (waited_s if start < wait_end else 0.0)  # the step, not the wait
        self._last_read_s = now
        return _StepOutput(tokens, finished, launched.plan.num_rows, step_s, waited_s, logprobs)

    def _validate(self, request: DecodeRequest, lifetime_s: float) -> None:
        request.params.validate()
        request.params.check_vocab(self.vocab_size)
        prompt_len, max_len = len(request.prompt_ids), self.scheduler.max_model_len
        if not request.request_id:
            raise InvalidRequestError("request_id is empty", param="request_id")
        if lifetime_s <= 0:
            raise DeadlineExceededError(f"{request.request_id}: deadline passed before Reserve")
        check_prompt_len(prompt_len, max_len)
        if max(request.prompt_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be < {self.vocab_size}", param="prompt_token_ids"
            )
        kv = self.scheduler.kv
        num_pages = kv.num_pages_for(self.scheduler.num_positions(prompt_len, request.params))
        if num_pages > kv.num_total_pages:
            raise InvalidRequestError(
                f"prompt + max_new_tokens need {num_pages} KV pages, more than this decode rank's "
                f"{kv.num_total_pages}",
                param="max_new_tokens",
            )

    def _report(
        self,
        replies: tuple[Reply, ...],
        output: _StepOutput,
        finished: list[Finished],
        expired: list[str],
    ) -> RankReport:
        request_ids = tuple(request_id for request_id, _ in output.tokens)
        token_ids = tuple(token_id for _, token_id in output.tokens)
        logprob_indices = tuple(i for i, r in enumerate(request_ids) if r in output.logprobs)
        return RankReport(
            replies=replies,
            token_request_ids=request_ids,
            token_ids=token_ids,
            logprob_indices=logprob_indices,
            logprobs=tuple(output.logprobs[request_ids[i]] for i in logprob_indices),
            finished=tuple(finished),
            expired=tuple(expired),
            load=self.load(),
            num_read_rows=output.num_rows,
            read_step_s=output.step_s,
            prefill_wait_s=output.prefill_wait_s,
        )

    def load(self) -> RankLoad:
        kv = self.scheduler.kv
        return RankLoad(
            page_size=kv.page_size,
            max_model_len=self.scheduler.max_model_len,
            num_total_pages=kv.num_total_pages,
            num_free_pages=kv.num_free_pages,
            num_used_pages=kv.num_used_pages,
            num_quarantined_pages=kv.num_quarantined_pages,
            num_running_requests=self.scheduler.num_running,
            num_reserved_requests=self.scheduler.num_reserved,
            max_running_requests=self.scheduler.max_running_requests,
        )


def create_receiver(init: RankInit, **kwargs: Any) -> BaseKVReceiver:
    """The KV receiver of ``init.kv_backend``, created in the rank that owns the pool."""
    return create_kv_receiver(TransferSpec(init.kv_backend, init.transfer_host), **kwargs)


def build_runner(init: RankInit, model: Qwen2_5_VLModel, device: str) -> ModelRunner:
    """The rank's runner and KV pool (its TP shard's heads); a batch as large as the rank runs
    replays a graph."""
    runner = ModelRunner(
        model,
        KVCacheConfig(
            init.num_pages,
            init.page_size,
            init.gpu_memory_utilization,
            init.max_running_requests,
            init.kv_cache_dtype,
        ),
        init.attention_backend,
        # DP attention too: the group's agreed rows per step pick the size every rank replays,
        # its requests padded to it or, with none, all padding (ModelRunner.set_dp_rows); every
        # rank captures the same sizes in the same order, the MLP collectives inside. No graphs
        # off CUDA, nor where MoE routing syncs with the host (capture_graphs): eager steps
        cuda_graph_batch_sizes=graph_batch_sizes(init.max_running_requests),
    )
    logger.info("%s on %s", runner.pool_size.describe(), device)
    return runner


def build_rank(
    init: RankInit,
    device: str,
    model: Qwen2_5_VLModel | None = None,
    receiver: BaseKVReceiver | None = None,
    quarantine_clock: Clock = time.monotonic,
    is_overlapped: bool = True,
    runner: ModelRunner | None = None,
    mirror: StepMirror | None = None,
) -> DecodeRank:
    """A decode rank whose KV pool is registered with ``receiver`` (default: ``init.kv_backend``'s).

    ``model``: an already loaded language model to share (tests); ``quarantine_clock``: when
    quarantined pages are due back (tests move it forward); ``is_overlapped``: False runs
    the synchronous loop (each step read before the next is planned); ``runner`` (with its
    pool registered with ``receiver``) and ``mirror``: a tensor-parallel rank's.
    """
    if receiver is None:  # a backend this device cannot run fails before the model loads
        check_kv_backend(init.kv_backend, init.kv_backend, device)
    if model is None:
        model = load_model(
            init.model,
            device=device,
            dtype=init.dtype,
            components=("language",),
            quantization=init.quantization,
        )
    is_registered = runner is not None
    runner = runner or build_runner(init, model, device)
    receiver = receiver if receiver is not None else create_receiver(init)
    try:
        if not is_registered:
            receiver.register(runner.kv_pool)
        eos_ids = model.config.eos_token_ids
        max_model_len = init.max_model_len or model.config.text.max_position_embeddings
        kv = KVReservationManager(runner.page_table, init.kv_quarantine_s, quarantine_clock)
        scheduler = DecodeScheduler(kv, eos_ids, max_model_len, init.max_running_requests)
        max_pages = min(kv.num_pages_for(max_model_len), runner.page_manager.num_pages)
        batch = DecodeBatchRunner(
            runner,
            Sampler(eos_ids),
            init.max_running_requests,
            max_pages,
            GrammarCache(init.model),
            mirror,
        )
    except BaseException:
        receiver.close()
        raise
    share = GpuShare(init.gpu_share_file) if init.gpu_share_file else None
    loop = StepLoop(batch, is_overlapped)
    return DecodeRank(
        scheduler, loop, receiver, gpu_share=share, prefill_first_s=init.prefill_first_s
    )
