"""One forward step of the model over the paged KV cache.

The runner owns the model, the KV pool, the request page table and the attention
backend. Callers (the offline engine, later the prefill and decode schedulers)
reserve pages for a request, then hand the runner a list of ``StepInput``: the new
tokens of each request, their positions and (prefill) the image embeddings already
merged in request-global order. The runner packs them ragged (step_inputs.py), plans
attention once, runs every layer and returns logits. DECODE steps and short EXTEND passes
replay the graphs captured at start where they fit them (runner_graphs.py).

Under DP attention (decode's ``--dp-attention``) the group agrees each step's rows per rank
before its forward (``set_dp_rows``); those rows alone pick the graph every rank replays,
its own requests padded to that size or, for a rank with none, all padding (``idle_decode``),
or that every rank runs eagerly (``dp_graph_size``, cuda_graph.py).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from services.engine import ops
from services.engine.attention import (
    AttentionBatch,
    ForwardMode,
    create_attention_backend,
    resolve_attention_backend,
)
from services.engine.cuda_graph import DEFAULT_BATCH_SIZES, dp_graph_size
from services.engine.gpu_defaults import DEFAULT_GPU_MEMORY_UTILIZATION
from services.engine.kv_cache import KVPageManager, KVPool, RequestPageTable, pool_scales
from services.engine.kv_sizing import (
    CPU_NUM_PAGES,
    PROFILE_NUM_PAGES,
    KVPoolSize,
    kv_element_size,
    kv_page_bytes,
    pages_for_memory,
)
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.quantization import AUTO_KV_CACHE_DTYPE
from services.engine.runner_graphs import capture_graphs
from services.engine.step_inputs import (
    DecodeInputs,
    StepInput,
    attention_batch,
    decode_batch,
    decode_inputs,
)


@dataclass(frozen=True)
class KVCacheConfig:
    """The pool's pages: ``num_pages``, or (None) a share of the GPU's memory sized at start
    (kv_sizing.py), ``CPU_NUM_PAGES`` off CUDA; and how they hold K and V (``dtype``)."""

    num_pages: int | None
    page_size: int
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # with num_pages None
    max_batch_size: int = DEFAULT_BATCH_SIZES[-1]  # the DECODE batch the sizing profiles
    dtype: str = AUTO_KV_CACHE_DTYPE  # --kv-cache-dtype: auto (the model's) | fp8_e4m3


class ModelRunner:
    def __init__(
        self,
        model: Qwen2_5_VLModel,
        kv_config: KVCacheConfig,
        attention_backend: str = "torch",
        cuda_graph_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,  # () turns graphs off
        prefill_graph_tokens: tuple[int, ...] = (),  # EXTEND graph token sizes; () turns them off
    ) -> None:
        text = model.config.text
        self.model = model
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.page_size = kv_config.page_size
        attention_backend = resolve_attention_backend(
            attention_backend, self.device, self.dtype, model.config.text.head_dim
        )
        scales = pool_scales(
            kv_config.dtype, model.kv_scales, text.num_hidden_layers, self.device
        )  # None: pages in the model's dtype
        self.pool_size = self._pool_size(
            kv_config,
            lambda num_pages: ModelRunner(
                model,
                replace(kv_config, num_pages=num_pages),
                attention_backend,
                cuda_graph_batch_sizes,
                prefill_graph_tokens,
            ),
        )
        num_pages = self.pool_size.num_pages
        self.kv_pool = KVPool(  # this TP rank's KV heads
            text.num_hidden_layers,
            num_pages,
            self.page_size,
            model.heads.num_kv_heads,
            text.head_dim,
            self.dtype,
            self.device,
            head_start=model.heads.kv_start,
            scales=scales,
        )
        self.page_manager = KVPageManager(num_pages, self.page_size)
        self.page_table = RequestPageTable(self.page_manager)
        self.attention = create_attention_backend(
            attention_backend,
            kv_pool=self.kv_pool,
            num_q_heads=model.heads.num_q_heads,
            num_kv_heads=model.heads.num_kv_heads,
            head_dim=text.head_dim,
        )
        self.cuda_graph, self.prefill_graphs = capture_graphs(
            model,
            self.attention,
            self.kv_pool,
            self.page_manager,
            cuda_graph_batch_sizes,
            prefill_graph_tokens,
        )

    def _page_bytes(self, kv_config: KVCacheConfig) -> int:
        text = self.model.config.text
        return kv_page_bytes(
            text.num_hidden_layers,
            kv_config.page_size,
            self.model.heads.num_kv_heads,
            text.head_dim,
            kv_element_size(kv_config.dtype, self.dtype.itemsize),
        )

    def _pool_size(
        self, kv_config: KVCacheConfig, profile_runner: Callable[[int], ModelRunner]
    ) -> KVPoolSize:
        """``kv_config.num_pages``, else the pages of ``kv_config.gpu_memory_utilization`` of
        this CUDA device next to what ``profile_runner`` holds at its peak (kv_sizing.py),
        ``CPU_NUM_PAGES`` off CUDA."""
        page_bytes = self._page_bytes(kv_config)
        if kv_config.num_pages is not None:
            return KVPoolSize(kv_config.num_pages, kv_config.page_size, page_bytes)
        if self.device.type != "cuda":
            return KVPoolSize(CPU_NUM_PAGES, kv_config.page_size, page_bytes, source="CPU default")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        profile_bytes = _profile(profile_runner(PROFILE_NUM_PAGES), kv_config.max_batch_size)
        gc.collect()
        peak_bytes = torch.cuda.max_memory_reserved(self.device)
        torch.cuda.empty_cache()
        total_bytes = torch.cuda.mem_get_info(self.device)[1]
        used_bytes = peak_bytes - profile_bytes
        utilization = kv_config.gpu_memory_utilization
        num_pages = pages_for_memory(total_bytes, utilization, used_bytes, page_bytes)
        return KVPoolSize(
            num_pages, kv_config.page_size, page_bytes, utilization, total_bytes, used_bytes
        )

    @torch.inference_mode()
    def encode_images(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """ViT forward; [num_image_tokens, hidden] in image order, on the runner's device."""
        with ops.on_device(self.device):
            return self.model.encode_images(pixel_values.to(self.device), grids)

    @torch.inference_mode()
    def forward(
        self,
        mode: ForwardMode,
        inputs: list[StepInput],
        all_logits: bool = False,
        input_ids: torch.Tensor | None = None,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[num_requests, vocab]`` (last new token of each) or ``[num_tokens, vocab]`` fp32.

        ``input_ids`` (DECODE only): the step's token ids already on the runner's device,
        ``[num_requests]`` int64 (e.g. the previous step's argmax); they replace each
        StepInput's ``input_ids[0]``, so a decode loop never waits on the host for its tokens.
        Nothing here synchronizes with the GPU: a loop may enqueue step N+1 before reading
        step N's results (consume each step's logits on the stream before the next call).
        ``on_layer_kv(i)`` (eager steps only, e.g. prefill) runs on this thread once layer i's
        attention (its KV store) is queued on the current stream, before its MLP: prefill queues
        that layer's KV copy to decode there.
        """
        with ops.on_device(self.device):  # the calling thread's current device may be another GPU
            return self._forward(mode, inputs, all_logits, input_ids, on_layer_kv)

    @torch.inference_mode()
    def forward_decode(
        self, inputs: DecodeInputs, before_launch: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` fp32 of one DECODE step; never synchronizes with the device.

        The logits may be a view of a CUDA graph's output: consume them on the stream
        (sample) before the next call. ``before_launch``: called once the step's inputs are
        staged and its attention planned, right before its forward is launched (decode waits
        there for a prefill forward on a shared GPU, its host work done).
        """
        with ops.on_device(self.device):
            return self._forward_decode(inputs, before_launch)

    def set_dp_rows(self, rows: int) -> None:
        """DP attention: the rows per rank the group agreed for its next forward. Where a graph
        holds them (``dp_graph_size``: the same answer on every rank), the step's rows become
        that graph's size, which the next DECODE step (``forward_decode``) or idle step
        (``idle_decode``) replays; else they stay ``rows``, and the step runs eagerly, each
        layer's MLP padding this rank's rows to them."""
        size = dp_graph_size(rows, () if self.cuda_graph is None else self.cuda_graph.batch_sizes)
        self.model.tp.step_rows[0] = rows if size is None else size

    @torch.inference_mode()
    def idle_decode(self) -> None:
        """DP attention: this rank's part of a step in which it has no request (set_dp_rows
        first): the agreed size's graph replayed with every row padding, or, eagerly, every
        layer's MLP joining the group's collectives with no rows of its own."""
        with ops.on_device(self.device):
            size = self._decode_graph_size(0)
            if size is not None:
                assert self.cuda_graph is not None
                self.cuda_graph.run_idle(size)
            else:
                self.model.model.idle(self.dtype, self.device)

    def _decode_graph_size(self, num_requests: int) -> int | None:
        """The graph size a DECODE step of ``num_requests`` replays; None: it runs eagerly.
        Under DP attention with the step's rows agreed (``set_dp_rows``) the group's size, from
        those rows alone; otherwise the smallest captured size that holds the requests."""
        graph = self.cuda_graph
        if graph is None:
            return None
        tp = self.model.tp
        if tp.dp_attention and tp.step_rows[0]:
            return dp_graph_size(tp.step_rows[0], graph.batch_sizes)
        return graph.graph_size(num_requests) if graph.can_run(num_requests) else None

    def _forward(
        self,
        mode: ForwardMode,
        inputs: list[StepInput],
        all_logits: bool,
        input_ids: torch.Tensor | None,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        if input_ids is not None:
            assert mode is ForwardMode.DECODE and input_ids.shape == (len(inputs),)
        if mode is ForwardMode.DECODE and not all_logits and on_layer_kv is None:
            return self._forward_decode(decode_inputs(inputs, input_ids, self.page_table))
        batch = attention_batch(mode, inputs, self.page_table)
        embeds = (
            self.model.embed(input_ids.to(self.device))
            if input_ids is not None
            else self._embed(inputs)
        )
        positions = torch.cat([s.positions for s in inputs], dim=1)
        logits_indices = None
        if not all_logits:
            ends = torch.tensor([len(s.input_ids) for s in inputs]).cumsum(0) - 1
            logits_indices = ends.to(self.device)
        if mode is ForwardMode.EXTEND:
            return self.forward_extend(embeds, positions, batch, logits_indices, on_layer_kv)
        self.attention.plan(batch)
        return self.model(
            embeds, positions.to(self.device), self.attention, logits_indices, on_layer_kv
        )

    def forward_extend(
        self,
        embeds: torch.Tensor,  # [T, hidden (+ DeepStack rows)] on the device, images merged in
        positions: torch.Tensor,  # [3, T] int64
        batch: AttentionBatch,  # EXTEND, T tokens, pages in this runner's pool
        logits_indices: torch.Tensor | None = None,  # see Qwen2_5_VLModel.forward
        on_layer_kv: Callable[[int], None] | None = None,  # see forward
    ) -> torch.Tensor:
        """Logits of one planned-here EXTEND pass: through the prefill graphs when it fits them,
        else eagerly. Call it inside ``ops.on_device(self.device)`` (``forward`` does)."""
        assert batch.mode is ForwardMode.EXTEND
        self.attention.plan(batch)
        graphs = self.prefill_graphs
        is_plain = embeds.shape[1] == self.model.config.text.hidden_size  # no DeepStack rows
        if graphs is not None and is_plain and graphs.can_run(batch.num_tokens):
            return graphs.forward(
                embeds, positions, batch.out_slots, self.attention, logits_indices, on_layer_kv
            )
        positions = positions.to(self.device)
        return self.model(embeds, positions, self.attention, logits_indices, on_layer_kv)

    def _forward_decode(
        self, inputs: DecodeInputs, before_launch: Callable[[], None] | None = None
    ) -> torch.Tensor:
        input_ids = inputs.input_ids.to(device=self.device, dtype=torch.long, non_blocking=True)
        batch = decode_batch(inputs, self.page_size)
        size = self._decode_graph_size(len(inputs.seq_lens))
        if size is not None:
            assert self.cuda_graph is not None
            return self.cuda_graph.run(batch, input_ids, inputs.positions, before_launch, size)
        self.attention.plan(batch)
        positions = inputs.positions.to(self.device, non_blocking=True)
        if before_launch is not None:
            before_launch()
        return self.model(self.model.embed(input_ids), positions, self.attention)

    def _embed(self, inputs: list[StepInput]) -> torch.Tensor:
        ids = torch.tensor(
            [t for s in inputs for t in s.input_ids], dtype=torch.long, device=self.device
        )
        rows, embeds, offset = [], [], 0
        for s in inputs:
            if s.image_embeds is not None and s.image_rows:
                rows.extend(offset + r for r in s.image_rows)
                embeds.append(s.image_embeds.to(self.device))
            offset += len(s.input_ids)
        if not embeds:
            return self.model.embed(ids)
        row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.embed(ids, torch.cat(embeds), row_index)


def _profile(runner: ModelRunner, batch_size: int) -> int:
    """Run one DECODE step of ``batch_size`` one-token rows on ``runner`` (graphs captured
    already), wait for it, and return the bytes of its pool; the caller drops the runner."""
    page = runner.page_manager.allocate(1)[0]
    slot = page * runner.page_size
    inputs = DecodeInputs(
        torch.zeros(batch_size, dtype=torch.long),
        torch.zeros(3, batch_size, dtype=torch.long),
        [1] * batch_size,
        [[page]] * batch_size,
        torch.full((batch_size,), slot, dtype=torch.long),
    )
    runner.forward_decode(inputs)
    torch.cuda.synchronize(runner.device)
    return 2 * runner.kv_pool.k_buffer.numel() * runner.kv_pool.k_buffer.element_size()
