"""``prompt_embeds``: precomputed prompt embeddings in vLLM's format, checked and unpacked once.

The format is ``torch.save`` of one dense tensor ``[num_tokens, hidden]`` (or
``[1, num_tokens, hidden]``) of float32, bfloat16 or float16: base64 in the HTTP API,
the raw bytes in the gRPC API. It is loaded with ``weights_only=True`` (no pickled code
runs) and travels on as raw little-endian rows; prefill checks the hidden size against
its model. Every failure is an ``InvalidRequestError`` naming ``prompt_embeds``.
"""

from __future__ import annotations

import binascii
import io

import msgspec
import torch

from services.common.errors import InvalidRequestError
from services.router.b64 import b64decode_strict

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
PARAM = "prompt_embeds"


class PromptEmbeds(msgspec.Struct, frozen=True):
    data: bytes  # [num_tokens, hidden] row-major, little-endian
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_tokens: int
    hidden_size: int


def from_base64(text: str) -> PromptEmbeds:
    try:
        raw = b64decode_strict(text)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("prompt_embeds is not valid base64", param=PARAM) from None
    return from_saved(raw)


def from_saved(raw: bytes) -> PromptEmbeds:
    """The tensor ``torch.save`` wrote into ``raw``, checked."""
    try:
        tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception:  # any malformed or hostile file: torch raises many types
        raise InvalidRequestError(
            "prompt_embeds is not a tensor saved with torch.save", param=PARAM
        ) from None
    if not isinstance(tensor, torch.Tensor):
        raise InvalidRequestError(
            f"prompt_embeds holds a {type(tensor).__name__}, not a tensor", param=PARAM
        )
    if tensor.layout is not torch.strided:
        raise InvalidRequestError(
            f"prompt_embeds must be a dense tensor, got {tensor.layout}", param=PARAM
        )
    if tensor.dtype not in DTYPES:
        raise InvalidRequestError(
            f"prompt_embeds dtype {tensor.dtype} is not one of float32, bfloat16, float16",
            param=PARAM,
        )
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 2 or tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise InvalidRequestError(
            f"prompt_embeds must be [num_tokens, hidden] with both > 0, got {list(tensor.shape)}",
            param=PARAM,
        )
    if not bool(torch.isfinite(tensor).all()):
        raise InvalidRequestError("prompt_embeds holds NaN or infinite values", param=PARAM)
    rows = tensor.contiguous()
    data = (
        rows.view(torch.uint8).numpy().tobytes()
        if rows.dtype is torch.bfloat16
        else rows.numpy().tobytes()
    )
    return PromptEmbeds(data, DTYPES[rows.dtype], rows.shape[0], rows.shape[1])
