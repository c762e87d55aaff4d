"""What the system benchmark holds on the GPU, counted before anything is built: the language
model's weights as prefill and each decode rank hold them, decode's KV pages, and whether a
single-GPU layout of them fits. Both follow ``--quantization`` and ``--kv-cache-dtype``
(benchmarks/precision.py): FP8 weights hold the decoder's dense linears in one byte a parameter
(and an fp32 scale per output channel), FP8 KV pages one byte an element."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.precision import Precision
from services.engine.config import ModelConfig
from services.engine.quantization import NO_QUANTIZATION

PAGE_SIZE = 16  # up's default
# Tokens a request's chat template adds around its text (28 with the bundled tokenizer), with
# room: each request's Reserve is for prompt + output tokens, and the default page count must
# hold every concurrent request's (at 16 tokens of room, 1000/1000 requests at c = 512 needed
# 127 pages each against the 126 given: the requests over ran into the 30 s queue limit).
TEMPLATE_TOKENS = 64


def default_num_pages(levels: tuple[int, ...], input_len: int, output_len: int, ranks: int) -> int:
    """Decode KV pages per rank for every request of the top level at once, prompt + output."""
    per_request = -(-(input_len + output_len + TEMPLATE_TOKENS) // PAGE_SIZE)
    return max(levels) * per_request // ranks + 64


def language_weight_bytes(config_dir: str | Path, quantization: str = NO_QUANTIZATION) -> int:
    """Bytes of the language model's tensors (the vision tower is the encoder's) as prefill and
    each decode rank hold them: ``config_dir``'s model built on the meta device in its dtype and
    finished as the loader finishes it (fused projections and their MLP padding; with fp8 the
    e4m3 weights and their fp32 scales), each storage counted once."""
    from services.engine.loader import finish_model, resolve_dtype
    from services.engine.model.registry import model_class

    config = ModelConfig.from_dir(config_dir)
    device = torch.device("meta")
    with device:
        model = model_class(config.architecture)(config)
    model.visual = None
    model.to(resolve_dtype(config.torch_dtype))
    finish_model(model, device, quantization)
    return held_bytes(model)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor ``model``'s modules hold (parameters, buffers and plain tensor
    attributes: the fused weights and FP8 scales), each storage once (the per-layer weights are
    views of the fused ones)."""
    storages = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def single_gpu_bytes(
    config_dir: str | Path, precision: Precision = Precision(), page_size: int = PAGE_SIZE
) -> tuple[int, int]:
    """Bytes of the language model's weights (``language_weight_bytes``; prefill and each decode
    rank hold one copy) and of one KV page, for ``config_dir`` in ``precision``."""
    from services.engine.kv_sizing import kv_element_size, kv_page_bytes
    from services.engine.loader import resolve_dtype

    config = ModelConfig.from_dir(config_dir)
    text, element_size = config.text, resolve_dtype(config.torch_dtype).itemsize
    page = kv_page_bytes(
        text.num_hidden_layers,
        page_size,
        text.num_key_value_heads,
        text.head_dim,
        kv_element_size(precision.kv_cache_dtype, element_size),
    )
    return language_weight_bytes(config_dir, precision.quantization), page


def fits_one_gpu(args: argparse.Namespace, num_pages: int) -> str | None:
    """Why prefill's and decode's weights and decode's KV pool cannot fit the one GPU they share
    (a lower bound: activations, CUDA graphs and the encoder not counted); None when they may,
    or when the layout spreads over several GPUs."""
    spread = (
        args.decode_device
        or args.decode_dp_attention
        or any(
            getattr(args, f) != 1 for f in ("prefill_tp", "prefill_ep", "decode_tp", "decode_ep")
        )
    )
    if args.quick or spread or not torch.cuda.is_available():
        return None
    precision = Precision.of(args)
    weights, page = single_gpu_bytes(args.config, precision)
    need = (1 + args.decode_dp) * weights + args.decode_dp * num_pages * page
    total = torch.cuda.get_device_properties(0).total_memory
    print(
        f"GPU memory ({' '.join(precision.flags()) or 'the checkpoint dtype'}): prefill's and "
        f"{args.decode_dp} decode rank(s)' weights {weights / 1e9:.1f} GB each, decode's KV "
        f"{num_pages} pages x {page / 1e6:.2f} MB = {num_pages * page / 1e9:.1f} GB per rank; "
        f"{need / 1e9:.1f} GB of the GPU's {total / 1e9:.1f} GB before activations",
        flush=True,
    )
    if need <= total:
        return None
    return (
        f"{args.config.name}: the weights and decode's KV pool need {need / 1e9:.1f} GB, more "
        f"than the GPU's {total / 1e9:.1f} GB: a lower --concurrency (or --num-pages: the top "
        "level then waits for pages), --kv-cache-dtype fp8_e4m3 or --quantization fp8 (where "
        "the run is to measure them), or a GPU with more memory"
    )
