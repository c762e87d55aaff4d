"""A prefill rank process's step class (``services.prefill.rank_step:PrefillRankStep``).

Built in each rank process by ``services.common.ranks.rank_main``: loads the language
model on the rank's device (its tensor-parallel shard: the world is CP ranks of ``tp_size``
ranks each, ``subgroups.split_world``; or, with ``tp_size`` 1 and ``ep_size`` the CP ranks,
its share of an MoE model's experts, the rest whole: ``model_split``), its local KV pool, its
KV sender and its embedding receiver (one buffer per rank: the encoder writes every image row
to every rank). Each step first all-gathers the payload's digest over the CPU group: ranks
that were handed different plans fail the step together instead of diverging in a collective.
"""

from __future__ import annotations

import logging
import os

import msgspec
import torch
import torch.distributed as dist

from services.common.destinations import KvDestination
from services.common.gpu_share import GpuShare
from services.common.kv_transfer import TransferSpec
from services.common.ranks.step import BaseRankStep, RankContext
from services.common.ranks.subgroups import (
    Subgroups,
    agree_on_manifest,
    model_manifest,
    split_world,
)
from services.common.types import SamplingParams
from services.engine.grammar import GrammarCache
from services.engine.kv_cache import KVPool
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.parallel import TensorParallel
from services.engine.prefill_graph import token_sizes_up_to
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, NO_QUANTIZATION
from services.prefill.host_tier import num_host_pages
from services.prefill.messages import (
    SHARDED,
    Describe,
    PassSegment,
    RankDescription,
    RankPayload,
    RankPlan,
    RankRequest,
    RankResult,
)
from services.prefill.store_tier import StoreWriter
from services.prefill.worker import PrefillRankWorker
from services.transfer import create_embedding_receiver, create_kv_sender
from services.transfer.base import pool_layout
from services.transfer.embeddings import EmbeddingBuffer

WARMUP_TOKENS = 8  # tokens per rank of the warm-up pass


logger = logging.getLogger(__name__)


class PrefillRankInit(msgspec.Struct, frozen=True):
    model: str
    dtype: str | None
    num_pages: int
    page_size: int
    embedding_rows: int
    attention_backend: str
    transfer_backend: str  # embedding rows
    kv_backend: str
    transfer_hostname: str  # Mooncake endpoints advertise it
    # CP all-gathers over the CPU (gloo) group, through host memory: ranks that share a GPU
    # (NCCL needs one GPU per rank)
    kv_exchange_over_cpu: bool = False
    cuda_graph_max_tokens: int = 0  # the prefill graphs' largest size (prefill_graph.py); 0: eager
    gpu_share_file: str = ""  # each rank marks its forwards there for decode (gpu_share.py)
    quantization: str = NO_QUANTIZATION  # the decoder's dense linears (engine/quantization.py)
    kv_cache_dtype: str = AUTO_KV_CACHE_DTYPE  # the KV pages (engine/quantization.py)
    host_cache_gb: float = 0.0  # the prefix cache's host tier (prefix_cache.py); 0: none
    kv_store_master: str = ""  # the prefix cache's shared KV store (store_tier.py); "": none
    kv_store_segment_bytes: int = 0
    kv_store_namespace: str = ""  # the model's: pages of another model are never read
    tp_size: int = 1  # ranks per CP rank's tensor-parallel group (subgroups.py)
    # ranks an MoE layer's experts split over: 1, tp_size, or (tp_size 1) the CP ranks
    ep_size: int = 1


class PrefillRankStep(BaseRankStep):
    init_type = PrefillRankInit
    payload_type = RankPayload
    result_type = RankResult

    def __init__(self, ctx: RankContext, init: PrefillRankInit) -> None:
        if ctx.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # C ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world_size))
        self.ctx = ctx
        self.gpu_share = GpuShare(init.gpu_share_file) if init.gpu_share_file else None
        self.tp_size = init.tp_size
        groups = split_world(ctx, init.tp_size, outer_over_cpu=init.kv_exchange_over_cpu)
        agree_on_manifest(ctx, manifest_of(init))
        tp = model_split(groups, init)
        model = load_model(
            init.model,
            device=ctx.device,
            dtype=init.dtype,
            components=("language",),
            quantization=init.quantization,
            tp=tp,
        )
        # a CPU rank runs its passes eagerly; so does one whose MLPs gather the CP ranks' rows
        # (a graph would bake one pass's gather size)
        eager = not ctx.device.startswith("cuda") or tp.dp_attention
        graph_tokens = () if eager else token_sizes_up_to(init.cuda_graph_max_tokens)
        # the graphs hold one page for their padding rows: the pool has one more, so the
        # leader's num_pages stay free for requests
        extra_page = int(bool(graph_tokens))
        runner = ModelRunner(
            model,
            KVCacheConfig(init.num_pages + extra_page, init.page_size, dtype=init.kv_cache_dtype),
            init.attention_backend,
            cuda_graph_batch_sizes=(),  # EXTEND only: decode graphs would hold a page for nothing
            prefill_graph_tokens=graph_tokens,
        )
        hostname = transfer_hostname(ctx, init)
        self.kv_sender = create_kv_sender(TransferSpec(init.kv_backend, hostname))
        self.receiver = create_embedding_receiver(
            TransferSpec(init.transfer_backend, hostname), cp_rank=groups.outer_rank
        )
        device = self.receiver.buffer_device(runner.device)
        buffer = EmbeddingBuffer(
            init.embedding_rows,
            model.config.embedding_row_width,
            runner.dtype,
            device,
            pin_memory=device.type == "cpu" and runner.device.type == "cuda",
        )
        self.receiver.register(buffer)
        self.store = connect_store(init, runner.kv_pool, hostname) if init.kv_store_master else None
        self.worker = PrefillRankWorker(
            runner,
            self.kv_sender,
            buffer,
            groups.outer_rank,
            groups.outer_size,
            groups.outer_group,
            exchange_device="cpu" if init.kv_exchange_over_cpu else None,
            gpu_share=self.gpu_share,
            grammars=GrammarCache(init.model),
            num_host_pages=num_host_pages(init.host_cache_gb, runner.kv_pool),
            store=self.store,
            tp_rank=groups.inner_rank,
            writes_kv=model.heads.is_kv_owner,
            share_slot=ctx.rank,
        )

    def warmup(self) -> None:
        """One sharded pass (every rank's collectives) of a text prompt, written nowhere."""
        runner = self.worker.runner
        num_tokens = WARMUP_TOKENS * self.worker.world_size
        pages = -(-num_tokens // runner.page_size)
        layout = pool_layout(runner.kv_pool)
        request = RankRequest(
            "warmup",
            tuple(range(num_tokens)),
            (),
            SamplingParams(temperature=0.0),
            KvDestination(self.kv_sender.backend, "", "warmup", layout, tuple(range(pages))),
            0.0,
            -1,
        )
        plan = RankPlan(-1, (request,), ((PassSegment(0, 0, num_tokens),),), SHARDED, WARMUP_TOKENS)
        self.worker.execute(plan, write_kv=False)

    def execute(self, step: int, payload: RankPlan | Describe) -> RankResult:
        digests = self._agree_on(payload)
        if isinstance(payload, Describe):  # a (re-)formed group: the leader's cache index is empty
            self.worker.prefix.clear()
            return RankResult(self.ctx.rank, digests, description=self.describe())
        done = self.worker.execute(payload)
        return RankResult(
            self.ctx.rank, digests, done.outcomes, done.forward_s, peer_failed=done.peer_failed
        )

    def on_failed(self, step: int, error: str) -> None:
        """A tensor- or expert-parallel rank that failed inside a plan's passes (it raised, or a
        peer did and its collective timed out) leaves: only a new group is in step again."""
        if self.worker.in_passes and (self.tp_size > 1 or self.worker.lockstep is not None):
            raise RuntimeError(
                f"step {step} failed inside a tensor- or expert-parallel pass: {error}"
            )

    def describe(self) -> RankDescription:
        buffer = self.receiver.buffer
        return RankDescription(
            self.receiver.destination("", 0, buffer.num_rows),
            pool_layout(self.worker.runner.kv_pool),
            self.kv_sender.backend,
            self.worker.prefix.num_host_pages,
            has_store=self.store is not None,
        )

    def _agree_on(self, payload: RankPlan | Describe) -> tuple[bytes, ...]:
        """Every rank's digest of ``payload`` (rank order); raises unless they are all equal."""
        digest = (
            RankPlan.digest(payload) if isinstance(payload, RankPlan) else b"describe".ljust(16)
        )
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        rows = [torch.empty_like(mine) for _ in range(self.ctx.world_size)]
        dist.all_gather(rows, mine, group=self.ctx.cpu_group)
        digests = tuple(r.numpy().tobytes() for r in rows)
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"the ranks were handed different plans (digests {[d.hex() for d in digests]})"
            )
        return digests

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.kv_sender.close()
        self.receiver.close()
        if self.gpu_share is not None:
            self.gpu_share.close()


def model_split(groups: Subgroups, init: PrefillRankInit) -> TensorParallel:
    """How this rank's model splits: over its TP group (heads, MLP, vocabulary; experts with
    ``ep_size`` = ``tp_size``), or, with ``tp_size`` 1 and ``ep_size`` > 1, DP attention over
    the CP group: attention, embedding and LM head whole, the MLP and experts split over the
    ``ep_size`` CP ranks (``lockstep.py``)."""
    if init.tp_size > 1 or init.ep_size == 1:
        return TensorParallel(
            groups.inner_rank, groups.inner_size, groups.inner_group, init.ep_size
        )
    assert init.ep_size == groups.outer_size, (init.ep_size, groups.outer_size)
    return TensorParallel(
        groups.outer_rank, groups.outer_size, groups.outer_group, init.ep_size, dp_attention=True
    )


def manifest_of(init: PrefillRankInit) -> dict[str, object]:
    """What this rank's group must agree on before it loads anything."""
    return model_manifest(
        init.model,
        dtype=init.dtype,
        quantization=init.quantization,
        kv_cache_dtype=init.kv_cache_dtype,
        tp_size=init.tp_size,
        ep_size=init.ep_size,
        page_size=init.page_size,
        num_pages=init.num_pages,
    )


def transfer_hostname(ctx: RankContext, init: PrefillRankInit) -> str:
    """The address this rank's transfer engines advertise: the service's (``--transfer-host``)
    for a rank spawned beside it, a joined rank's own (``join-rank --host``)."""
    return ctx.host if ctx.joined else init.transfer_hostname


def connect_store(init: PrefillRankInit, pool: KVPool, hostname: str) -> StoreWriter | None:
    """This rank's client of the shared KV store; None (logged) when it cannot connect: the
    rank says so in ``Describe`` and the leader then uses the store on no rank."""
    from services.prefill.kv_store import KvStore, PageLayout
    from services.prefill.kv_store_calls import KvStoreError

    try:
        client = KvStore(
            init.kv_store_master,
            init.kv_store_namespace,
            PageLayout.of(pool),
            local_hostname=hostname or "127.0.0.1",
            segment_bytes=init.kv_store_segment_bytes,
        )
    except (ImportError, ValueError, KvStoreError) as exc:
        logger.warning("no KV store on this rank: %s", exc)
        return None
    return StoreWriter(client)
