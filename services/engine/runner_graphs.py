"""The graphs a ``ModelRunner`` captures when it starts.

On CUDA, with an attention backend that supports graphs, DECODE steps of up to
``max(cuda_graph_batch_sizes)`` requests replay captured CUDA graphs (cuda_graph.py); with
``prefill_graph_tokens``, EXTEND passes of up to their largest size run every layer but
attention as captured pieces (prefill_graph.py; off CUDA the same pieces run eagerly).
Either holds one KV page for good as the padding rows' scratch page. None is captured on
CUDA for a model whose MoE routing syncs with the host. Under DP attention every rank of the
group captures the same DECODE sizes in the same order, the group's MLP collectives (NCCL)
inside each graph; each step's agreed rows pick the size every rank replays (cuda_graph.py).
"""

from __future__ import annotations

from services.engine import ops
from services.engine.attention import BaseAttentionBackend
from services.engine.cuda_graph import CudaGraphDecodeRunner
from services.engine.kv_cache import KVPageManager, KVPool
from services.engine.model.moe import moe_syncs_host
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.prefill_graph import PrefillGraphs


def capture_graphs(
    model: Qwen2_5_VLModel,
    attention: BaseAttentionBackend,
    kv_pool: KVPool,
    page_manager: KVPageManager,
    cuda_graph_batch_sizes: tuple[int, ...],  # () turns DECODE graphs off
    prefill_graph_tokens: tuple[int, ...],  # () turns EXTEND graphs off
) -> tuple[CudaGraphDecodeRunner | None, PrefillGraphs | None]:
    """The DECODE graphs and the EXTEND graphs over ``kv_pool``, each None where not captured;
    the scratch page comes from ``page_manager``."""
    device = model.lm_head.weight.device
    decode_graphs = bool(cuda_graph_batch_sizes) and device.type == "cuda"
    decode_graphs = decode_graphs and attention.supports_cuda_graph
    if not (decode_graphs or prefill_graph_tokens):
        return None, None
    if device.type == "cuda" and moe_syncs_host(model):
        return None, None
    scratch_page = page_manager.allocate(1)[0]  # held for good: padding writes here
    cuda_graph, prefill_graphs = None, None
    if decode_graphs:
        cuda_graph = CudaGraphDecodeRunner(
            model,
            attention,
            page_manager.page_size,
            scratch_page,
            page_manager.num_pages,
            cuda_graph_batch_sizes,
        )
        with ops.on_device(device):
            cuda_graph.capture()
    if prefill_graph_tokens:  # attention runs between the pieces: any backend; off CUDA, eager
        scratch_slot = scratch_page * page_manager.page_size
        prefill_graphs = PrefillGraphs(model, kv_pool, scratch_slot, prefill_graph_tokens)
        with ops.on_device(device):
            prefill_graphs.capture()
    return cuda_graph, prefill_graphs
