"""The engine's rows: prefill, decode (CUDA graphs on) and ViT, each against its floor."""

from __future__ import annotations

import time

import numpy as np
import torch

from benchmarks.measure import Ceilings, decode_floor_bytes, prefill_flops, time_ms, vit_flops
from benchmarks.report import Row
from services.common.types import SamplingParams
from services.decode.batch import DecodeBatchRunner, StepLoop
from services.decode.scheduler import DecodePlan, JoinedRow
from services.engine.attention import ForwardMode
from services.engine.config import VisionConfig
from services.engine.cuda_graph import graph_batch_sizes
from services.engine.kv_cache import KVPool
from services.engine.kv_sizing import kv_page_bytes
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.quantization import AUTO_KV_CACHE_DTYPE
from services.engine.sampler import Sampler
from services.engine.step_inputs import StepInput

PAGE_SIZE = 16
PREFILL_LENS = (1024, 8192, 32768)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (1024, 4096)
# Qwen2.5-VL's 1080p grid: 1080x1920 resized to multiples of 28, 1092x1932 pixels, 14-pixel
# patches (Qwen3-VL's, 16-pixel patches: 1088x1920 pixels, (1, 68, 120); ``grid_1080p``)
GRID_1080P = (1, 78, 138)
IMAGE_COUNTS = (1, 8)


def make_runner(
    model: Qwen2_5_VLModel,
    max_tokens: int,
    attention_backend: str = "flashinfer",
    max_batch: int = max(DECODE_BATCHES),
    kv_cache_dtype: str = AUTO_KV_CACHE_DTYPE,
) -> ModelRunner:
    """A runner with decode graphs up to ``max_batch``, as a decode rank of that batch has, its
    pool's pages in ``kv_cache_dtype`` (``--kv-cache-dtype``)."""
    num_pages = -(-max_tokens // PAGE_SIZE) + max_batch + 2  # + last partial pages + scratch
    runner = ModelRunner(
        model,
        KVCacheConfig(num_pages, PAGE_SIZE, dtype=kv_cache_dtype),
        attention_backend,
        cuda_graph_batch_sizes=graph_batch_sizes(max_batch),
    )
    fill_random(runner.kv_pool)  # never time attention over zeros
    return runner


def fill_random(pool: KVPool) -> None:
    """Normal values in every page of ``pool``, a layer at a time: FP8 pages take them through
    the model's dtype (torch draws no normal values in e4m3)."""
    for cache in (*pool.k_cache, *pool.v_cache):  # L x [P, S, Hkv, D] each
        if cache.dtype == pool.value_dtype:
            cache.normal_()
        else:
            cache.copy_(torch.randn(cache.shape, dtype=pool.value_dtype, device=cache.device))


def prefill_rows(
    runner: ModelRunner, ceilings: Ceilings, lens: tuple[int, ...] = PREFILL_LENS
) -> list[Row]:
    config = runner.model.config
    rows = []
    for num_tokens in lens:
        request_id = f"prefill-{num_tokens}"
        runner.page_table.reserve(request_id, num_tokens)
        ids = torch.randint(0, config.text.vocab_size, (num_tokens,)).tolist()
        step = StepInput(request_id, ids, torch.arange(num_tokens).expand(3, -1), 0)
        iters = 2 if num_tokens > 16384 else 5
        try:
            ms = time_ms(
                lambda step=step: runner.forward(ForwardMode.EXTEND, [step]), warmup=1, iters=iters
            )
        finally:
            runner.page_table.release(request_id)
        flops = prefill_flops(config, num_tokens)
        rows.append(
            Row(
                "prefill",
                prefill_row_name(num_tokens),
                ms,
                flops / ceilings.matmul_flops_per_s * 1e3,
                note=f"{flops / ms / 1e9:.0f} TFLOP/s",
            )
        )
    return rows


def _decode_steps(request_ids: list[str], context_len: int) -> list[StepInput]:
    position = torch.full((3, 1), context_len, dtype=torch.long)
    return [StepInput(r, [7], position, context_len) for r in request_ids]


def decode_rows(
    runner: ModelRunner,
    ceilings: Ceilings,
    contexts: tuple[int, ...] = DECODE_CONTEXTS,
    batches: tuple[int, ...] = DECODE_BATCHES,
) -> list[Row]:
    """Time per step of a pipelined greedy decode loop (``decode_loop_ms``), host work included."""
    rows = []
    pages = runner.page_manager.num_free_pages
    for context_len in contexts:
        per_request = -(-(context_len + 1) // PAGE_SIZE)
        fitting = [b for b in batches if b * per_request <= pages]
        request_ids = [f"decode-{context_len}-{i}" for i in range(max(fitting, default=0))]
        try:
            for request_id in request_ids:
                runner.page_table.reserve(request_id, context_len + 1)
            for batch_size in batches:
                if batch_size not in fitting:  # the pool the card holds beside the weights
                    rows.append(_unfit_row(runner, batch_size, context_len, per_request, pages))
                    continue
                rows.append(_decode_row(runner, ceilings, request_ids[:batch_size], context_len))
        finally:
            for request_id in request_ids:
                runner.page_table.release(request_id)
    return rows


def _unfit_row(
    runner: ModelRunner, batch_size: int, context_len: int, per_request: int, pages: int
) -> Row:
    page_gb = runner.kv_pool.k_buffer[:, :1].nbytes * 2 / 1e9
    note = (
        f"does not fit: {batch_size * per_request * page_gb:.1f} GB of KV against the "
        f"{pages * page_gb:.1f} GB pool the card holds beside the weights"
    )
    return Row("decode", decode_row_name(batch_size, context_len), None, None, note=note)


def pages_that_fit(model: Qwen2_5_VLModel, wanted_tokens: int, share: float = 0.8) -> int:
    """Tokens of KV (whole pages) for a decode runner: ``wanted_tokens``, or what ``share`` of
    the device's free memory holds (the graphs and activations keep the rest)."""
    text = model.config.text
    page_bytes = kv_page_bytes(
        text.num_hidden_layers,
        PAGE_SIZE,
        model.heads.num_kv_heads,
        text.head_dim,
        model.lm_head.weight.element_size(),
    )
    free_bytes, _ = torch.cuda.mem_get_info(model.lm_head.weight.device)
    return min(wanted_tokens, int(free_bytes * share) // page_bytes * PAGE_SIZE)


def decode_batch(runner: ModelRunner, steps: list[StepInput]) -> DecodeBatchRunner:
    """The decode rank's batch runner (services/decode/batch.py) sized for ``steps``' rows."""
    max_pages = max(len(runner.page_table.pages(s.request_id)) for s in steps)
    return DecodeBatchRunner(runner, Sampler(), len(steps), max_pages)


def fixed_plans(runner: ModelRunner, steps: list[StepInput], num_steps: int) -> list[DecodePlan]:
    """``num_steps`` greedy plans of the rows of ``steps``, every one at its StepInput's position
    (positions do not advance); the first plan joins every row with its ``input_ids[0]``."""
    n = len(steps)
    greedy = SamplingParams(temperature=0.0)
    joined = tuple(
        JoinedRow(slot, s.input_ids[0], greedy, (), runner.page_table.pages(s.request_id))
        for slot, s in enumerate(steps)
    )
    fields = dict(
        request_ids=tuple(s.request_id for s in steps),
        slots=np.arange(n, dtype=np.int64),
        seq_lens=np.array([s.prefix_len for s in steps], dtype=np.int64),
        positions=np.array([int(s.positions[0, 0]) for s in steps], dtype=np.int64),
        num_output_ids=np.ones(n, dtype=np.int64),
    )
    return [DecodePlan(step=i, joined=joined if i == 0 else (), **fields) for i in range(num_steps)]


def decode_loop(
    runner: ModelRunner,
    steps: list[StepInput],
    num_steps: int,
    batch: DecodeBatchRunner | None = None,
    is_overlapped: bool = True,
) -> list[list[int]]:
    """A greedy decode loop as the decode service's rank runs it: its ``StepLoop`` over its batch
    runner. Overlapped, the host plans step N+1 while the GPU runs step N: each step's samples
    stay on the device as the next step's input, and their copy to pinned host memory is read
    one step late (the only host sync). Returns the tokens of every step, as the host read them."""
    loop = StepLoop(batch or decode_batch(runner, steps), is_overlapped)
    out = []
    for plan in fixed_plans(runner, steps, num_steps):
        if (done := loop.step(plan)) is not None:
            out.append(done[1])
    while loop.has_unread:
        done = loop.step(None)
        assert done is not None
        out.append(done[1])
    return out


def decode_loop_ms(
    runner: ModelRunner,
    steps: list[StepInput],
    num_steps: int = 40,
    warmup: int = 5,
    is_overlapped: bool = True,
) -> float:
    """Steady-state wall time per step of ``decode_loop``: every step of a ``num_steps`` loop
    (fill and drain included), host clock from the first call to the last token read."""
    batch = decode_batch(runner, steps)
    decode_loop(runner, steps, warmup, batch, is_overlapped)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    start = time.perf_counter()
    decode_loop(runner, steps, num_steps, batch, is_overlapped)
    return (time.perf_counter() - start) * 1e3 / num_steps


def _decode_row(
    runner: ModelRunner, ceilings: Ceilings, request_ids: list[str], context_len: int
) -> Row:
    batch_size = len(request_ids)
    steps = _decode_steps(request_ids, context_len)
    ms = decode_loop_ms(runner, steps)
    sync_ms = decode_loop_ms(runner, steps, num_steps=20, warmup=3, is_overlapped=False)
    note = ""
    if runner.cuda_graph is not None and runner.cuda_graph.can_run(batch_size):
        graph = runner.cuda_graph
        replay_ms = time_ms(lambda: graph.replay(batch_size), warmup=2, iters=20)
        note = f"graph replay alone {replay_ms:.3f} ms; "
    note += f"unpipelined step {sync_ms:.3f} ms; "
    floor = (
        decode_floor_bytes(runner.model, batch_size, context_len + 1)
        / ceilings.copy_bytes_per_s
        * 1e3
    )
    note += f"{batch_size / ms * 1e3:.0f} tok/s"
    return Row("decode", decode_row_name(batch_size, context_len), ms, floor, note=note)


def grid_1080p(vision: VisionConfig) -> tuple[int, int, int]:
    """The patch grid of a 1920x1080 image for this vision tower: each side rounded to a multiple
    of patch x merge pixels (the processor's ``smart_resize``; 1080p is inside both Qwen
    configs' pixel limits), in patches."""
    factor = vision.patch_size * vision.spatial_merge_size
    return tuple(  # type: ignore[return-value]
        (1, *(round(side / factor) * factor // vision.patch_size for side in (1080, 1920)))
    )


def image_pixels(
    model: Qwen2_5_VLModel, num_images: int
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Random pixel patches of ``num_images`` 1080p images, [patches, C*T*P*P], on the model's
    device (the grid of its own patch size: ``grid_1080p``)."""
    v = model.config.vision
    grids = [grid_1080p(v)] * num_images
    num_patches = sum(t * h * w for t, h, w in grids)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    weight = model.lm_head.weight
    pixels = torch.randn(num_patches, patch_dim, dtype=weight.dtype, device=weight.device)
    return pixels, grids


def vit_rows(
    runner: ModelRunner, ceilings: Ceilings, counts: tuple[int, ...] = IMAGE_COUNTS
) -> list[Row]:
    rows = []
    for num_images in counts:
        pixels, grids = image_pixels(runner.model, num_images)
        ms = time_ms(
            lambda pixels=pixels, grids=grids: runner.encode_images(pixels, grids),
            warmup=2,
            iters=5,
        )
        flops = vit_flops(runner.model.config, grids)
        name = vit_row_name(num_images)
        rows.append(
            Row(
                "vit",
                name,
                ms,
                flops / ceilings.matmul_flops_per_s * 1e3,
                note=f"{flops / ms / 1e9:.0f} TFLOP/s",
            )
        )
    return rows


def vit_row_name(num_images: int) -> str:
    return f"{num_images} image{'s' if num_images > 1 else ''} 1080p"


def decode_row_name(batch_size: int, context_len: int) -> str:
    return f"batch {batch_size}, ctx {context_len // 1024}k"


def prefill_row_name(num_tokens: int) -> str:
    return f"{num_tokens // 1024}k tokens"
