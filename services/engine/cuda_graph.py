"""CUDA graphs for decode: the whole step (embedding, every layer with its attention, LM head).

One graph per captured batch size. A step of ``n`` requests runs the graph of the
smallest captured size ``B >= n``: rows ``n..B-1`` are padding, each a one-token
request whose only page is the runner's scratch page, so padding writes its K/V
there and never into a real request's pages. Inputs travel in one host-to-device
copy into fixed buffers; attention metadata is re-planned into the backend's fixed
buffers; then the graph replays. Batches above the largest size run eagerly.

The returned logits are a view of the graph's output: valid until the next ``run``'s
replay, in stream order, so a caller consumes them on the stream (argmax) before the
next ``run``. Token ids may come as a device tensor (the previous step's argmax): they
are copied into the fixed buffer on the stream, so no host sync is needed between steps.
``run`` never synchronizes with the GPU, so the host can plan step N+1 while step N
replays: every device-side write of ``run`` (input upload, attention metadata) is
stream-ordered after step N's replay, and the only thing the host rewrites early, the
pinned staging memory, is guarded by an event recorded after its upload.

Under DP attention (``TensorParallel.dp_attention``) each graph holds the step's MLP
collectives, whose size is the group's rows per rank: every rank of the group must replay a
graph of the same size in a step. That size is picked from the rows the group agreed
(``dp_graph_size``), not from a rank's own requests: a rank replays it with its own rows and
the rest padding (``run(..., size=)``), or, with no request of its own, all padding
(``run_idle``: attention over the scratch page, the MLPs joining the collectives). Each size
is captured with ``step_rows`` set to it, so ``mlp_rows`` pads nothing inside the graph, and
every rank captures the same sizes in the same order (largest first), so the collectives of
the warm-up forwards and of the captures line up across the group. CUDA only: the group's
collectives are then NCCL's, which a graph can hold (gloo's cannot; off CUDA nothing is
captured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from services.engine.attention.base import AttentionBatch, BaseAttentionBackend, ForwardMode
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
LARGE_BATCH_STEP = 64  # graph sizes above the defaults' 256: every 64 requests
MAX_GRAPH_BATCH = 1024  # larger batches run eagerly (each size's logits hold B x vocab fp32)


def graph_batch_sizes(max_batch: int) -> tuple[int, ...]:
    """Graph sizes for a runner whose batches reach ``max_batch``: the defaults up to it, then
    every ``LARGE_BATCH_STEP`` up to it (rounded up; at most ``MAX_GRAPH_BATCH``), so a batch
    past the defaults' largest size does not fall back to an eager step."""
    top = min(-(-max_batch // LARGE_BATCH_STEP) * LARGE_BATCH_STEP, MAX_GRAPH_BATCH)
    large = range(DEFAULT_BATCH_SIZES[-1] + LARGE_BATCH_STEP, top + 1, LARGE_BATCH_STEP)
    small = [b for b in DEFAULT_BATCH_SIZES if b < max_batch]
    covering = [b for b in DEFAULT_BATCH_SIZES if b >= max_batch][:1]
    return tuple(small + covering + list(large))


def dp_graph_size(rows: int, batch_sizes: Sequence[int]) -> int | None:
    """DP attention: the graph size every rank of the group replays in a step the group agreed
    at ``rows`` rows per rank, the smallest of ``batch_sizes`` (the captured sizes) that holds
    them; None: every rank runs the step eagerly (``rows`` 0: no forward at all; past the
    largest size, or no graphs). A function of the agreed rows and the captured sizes alone,
    both the same on every rank (one init captures the same sizes everywhere), so every rank
    replays the same size or none does."""
    if rows <= 0:
        return None
    return next((size for size in sorted(batch_sizes) if size >= rows), None)


_IDS, _POS, _SLOTS = 0, slice(1, 4), 4  # rows of the fixed input buffer


class CudaGraphDecodeRunner:
    """Captures decode graphs for ``batch_sizes`` and replays them; owns the fixed input buffers."""

    def __init__(
        self,
        model: Qwen2_5_VLModel,
        attention: BaseAttentionBackend,
        page_size: int,
        scratch_page: int,
        max_num_pages: int,
        batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
    ) -> None:
        assert attention.supports_cuda_graph, (
            f"{type(attention).__name__} cannot run inside CUDA graphs"
        )
        assert batch_sizes and all(b > 0 for b in batch_sizes)
        self.model = model
        self.attention = attention
        self.page_size = page_size
        self.scratch_page = scratch_page
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch_size = self.batch_sizes[-1]
        device = model.lm_head.weight.device
        # rows: input ids, positions (3 rows), out slots; [5, max_batch_size] int64
        self._inputs = torch.zeros(5, self.max_batch_size, dtype=torch.long, device=device)
        self._inputs_host = torch.zeros(5, self.max_batch_size, dtype=torch.long, pin_memory=True)
        self._staged = torch.cuda.Event()  # recorded after the last upload from the pinned staging
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # [B, vocab] fp32, graph outputs
        self._pool: tuple[int, int] | None = None
        attention.init_cuda_graph(self.batch_sizes, max_num_pages + self.max_batch_size)

    def can_run(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.max_batch_size

    def graph_size(self, num_requests: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_requests)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs reuse its memory pool). Under
        DP attention every rank of the group calls it at once: each size's warm-up and capture
        run its MLP collectives at ``step_rows`` = that size (module docstring)."""
        tp = self.model.tp
        step_rows = tp.step_rows if tp.dp_attention else [0]  # read under DP attention only
        agreed = step_rows[0]
        try:
            for size in reversed(self.batch_sizes):
                step_rows[0] = size  # DP attention: size rows per rank, mlp_rows pads nothing
                self._stage_padding(size)
                self._forward(size)  # warm-up outside the graph: kernels, library handles, NCCL
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self._logits[size] = self._forward(size)
                self._pool = graph.pool()
                self._graphs[size] = graph
            torch.cuda.synchronize()
        finally:
            step_rows[0] = agreed

    @torch.inference_mode()
    def run(
        self,
        batch: AttentionBatch,  # DECODE, len(seq_lens) <= max_batch_size; out_slots on any device
        input_ids: torch.Tensor,  # [n] int64, CPU, or on the graph's device (copied on the stream)
        positions: torch.Tensor,  # [3, n] int64, CPU
        before_replay: Callable[[], None] | None = None,  # called once staged and planned
        size: int | None = None,  # the graph to replay (DP attention: the group's); None: from n
    ) -> torch.Tensor:  # [n, vocab] fp32, a view of the graph output
        """One step of ``n`` requests in the graph of ``size`` (default: the smallest captured
        size that holds them); its rows past ``n`` are padding."""
        assert batch.mode is ForwardMode.DECODE
        n = len(batch.seq_lens)
        size = self.graph_size(n) if size is None else size
        assert 0 < n <= size, f"{n} requests in the graph of {size}"
        assert size in self._graphs, f"no graph of {size} captured (capture() runs first)"
        on_device = input_ids.device.type != "cpu"
        host_ids = torch.zeros(n, dtype=torch.long) if on_device else input_ids
        self._stage_inputs(size, host_ids, positions, batch.out_slots.cpu())
        if on_device:
            self._inputs[_IDS, :n].copy_(input_ids, non_blocking=True)
        self.attention.plan_cuda_graph(self._padded_batch(size, batch.seq_lens, batch.page_tables))
        if before_replay is not None:
            before_replay()
        self._graphs[size].replay()
        return self._logits[size][:n]

    @torch.inference_mode()
    def run_idle(self, size: int) -> torch.Tensor:
        """DP attention: a rank's step without requests in the group's graph of ``size``, every
        row padding (attention over the scratch page; its MLPs join the group's collectives).
        Returns the graph's logits, ``[size, vocab]`` fp32, all of padding."""
        assert size in self._graphs, f"no graph of {size} captured (capture() runs first)"
        self._stage_padding(size)
        self._graphs[size].replay()
        return self._logits[size]

    def replay(self, num_requests: int) -> torch.Tensor:
        """Replay the graph ``run`` last planned for this many requests (no re-staging; for timing)."""
        size = self.graph_size(num_requests)
        self._graphs[size].replay()
        return self._logits[size][:num_requests]

    def _forward(self, size: int) -> torch.Tensor:
        embeds = self.model.embed(self._inputs[_IDS, :size])  # [B, hidden]
        return self.model(embeds, self._inputs[_POS, :size], self.attention)  # [B, vocab] fp32

    def _stage_padding(self, size: int) -> None:
        """Inputs and attention plan of ``size`` rows, all padding."""
        empty = torch.empty(0, dtype=torch.long)
        self._stage_inputs(size, empty, torch.empty(3, 0, dtype=torch.long), empty)
        self.attention.plan_cuda_graph(self._padded_batch(size, [], []))

    def _stage_inputs(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor
    ) -> None:
        n = input_ids.numel()
        host = self._inputs_host
        self._staged.synchronize()  # the previous upload has left the pinned staging (no-op before the first)
        host[:, n:size] = 0
        host[_SLOTS, n:size] = self.scratch_page * self.page_size
        host[_IDS, :n] = input_ids
        host[_POS, :n] = positions
        host[_SLOTS, :n] = out_slots
        self._inputs.copy_(host, non_blocking=True)
        self._staged.record()

    def _padded_batch(
        self, size: int, seq_lens: list[int], page_tables: list[list[int]]
    ) -> AttentionBatch:
        num_padding = size - len(seq_lens)
        return AttentionBatch(
            mode=ForwardMode.DECODE,
            seq_lens=list(seq_lens) + [1] * num_padding,
            extend_lens=[1] * size,
            page_tables=list(page_tables) + [[self.scratch_page]] * num_padding,
            page_size=self.page_size,
            out_slots=self._inputs[_SLOTS, :size],
        )
