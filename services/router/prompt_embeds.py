"""``prompt_embeds``: precomputed prompt embeddings in vLLM's format, checked and unpacked once.

The format is ``torch.save`` of one dense tensor ``[num_tokens, hidden]`` (or
``[1, num_tokens, hidden]``) of float32, bfloat16 or float16: base64 in the HTTP API, the raw
bytes in the gRPC API. It is not given to ``torch.load``: ``saved_tensor`` reads the file's
header (no pickled code runs), and dtype, shape, row count (below the context limit), hidden
size (at most ``MAX_HIDDEN_SIZE``) and layout (row-major from the storage's start: no zero,
transposed or offset strides) are checked before any element is read. The rows are then the
storage member's own bytes, so what a request costs is bounded by its size on the wire, never by
the shape it claims. They travel on as raw little-endian rows; prefill checks the hidden size
against its model. Every failure is an ``InvalidRequestError`` naming ``prompt_embeds``.
"""

from __future__ import annotations

import binascii

import msgspec
import numpy as np

from services.common.errors import InvalidRequestError
from services.router.b64 import Base64TooLargeError, b64decode_strict
from services.router.saved_tensor import ITEMSIZES, SavedFile, SavedTensorError, TensorHeader

PARAM = "prompt_embeds"
DTYPES = ("float32", "bfloat16", "float16")
MAX_HIDDEN_SIZE = 32768
MAX_FILE_OVERHEAD_BYTES = 256 * 1024  # the zip's headers, data.pkl and small members
# dtype -> (unsigned view, exponent mask): all exponent bits set is NaN or infinity
_EXPONENTS = {
    "float32": (np.uint32, 0x7F800000),
    "bfloat16": (np.uint16, 0x7F80),
    "float16": (np.uint16, 0x7C00),
}


class PromptEmbeds(msgspec.Struct, frozen=True):
    data: bytes  # [num_tokens, hidden] row-major, little-endian
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_tokens: int
    hidden_size: int


def max_file_bytes(max_context_len: int) -> int:
    """The largest file that can hold an acceptable tensor: fewer rows than the context, float32,
    ``MAX_HIDDEN_SIZE`` wide, plus the zip's overhead."""
    return (max_context_len - 1) * MAX_HIDDEN_SIZE * 4 + MAX_FILE_OVERHEAD_BYTES


def from_base64(text: str, max_context_len: int) -> PromptEmbeds:
    try:
        raw = b64decode_strict(text, max_file_bytes(max_context_len))
    except Base64TooLargeError:
        raise InvalidRequestError(
            f"prompt_embeds is larger than {max_file_bytes(max_context_len)} bytes, the most a "
            f"tensor of fewer than {max_context_len} rows of {MAX_HIDDEN_SIZE} float32 takes",
            param=PARAM,
        ) from None
    except (binascii.Error, ValueError):
        raise InvalidRequestError("prompt_embeds is not valid base64", param=PARAM) from None
    return from_saved(raw, max_context_len)


def from_saved(raw: bytes, max_context_len: int) -> PromptEmbeds:
    """The tensor ``torch.save`` wrote into ``raw``, checked against a context of
    ``max_context_len`` tokens before anything but its header is read."""
    try:
        saved = SavedFile(raw)
        header = saved.header()
    except SavedTensorError as exc:
        raise _not_saved(exc) from None
    if not isinstance(header, TensorHeader):
        raise InvalidRequestError(
            f"prompt_embeds holds a {type(header).__name__}, not a tensor", param=PARAM
        )
    num_tokens, hidden_size = _checked_shape(header, max_context_len)
    try:
        data = saved.storage_bytes(header.storage)
    except SavedTensorError as exc:
        raise _not_saved(exc) from None
    dtype = header.storage.dtype
    nbytes = num_tokens * hidden_size * ITEMSIZES[dtype]
    if len(data) != nbytes:
        data = data[:nbytes]
    unsigned, exponent = _EXPONENTS[dtype]
    bits = np.frombuffer(data, dtype=np.dtype(unsigned).newbyteorder("<"))
    if np.any((bits & exponent) == exponent):
        raise InvalidRequestError("prompt_embeds holds NaN or infinite values", param=PARAM)
    return PromptEmbeds(data, dtype, num_tokens, hidden_size)


def _not_saved(exc: SavedTensorError) -> InvalidRequestError:
    return InvalidRequestError(
        f"prompt_embeds is not a tensor saved with torch.save: {exc}", param=PARAM
    )


def _checked_shape(header: TensorHeader, max_context_len: int) -> tuple[int, int]:
    """(num_tokens, hidden) of an acceptable header; ``InvalidRequestError`` otherwise."""
    dtype = header.storage.dtype
    if dtype not in DTYPES:
        raise InvalidRequestError(
            f"prompt_embeds dtype {dtype} is not one of {', '.join(DTYPES)}", param=PARAM
        )
    shape = header.shape[1:] if len(header.shape) == 3 and header.shape[0] == 1 else header.shape
    if len(shape) != 2 or 0 in shape:
        raise InvalidRequestError(
            f"prompt_embeds must be [num_tokens, hidden] with both > 0, got {list(header.shape)}",
            param=PARAM,
        )
    num_tokens, hidden_size = shape
    if num_tokens >= max_context_len:
        raise InvalidRequestError(
            f"prompt_embeds has {num_tokens} rows (tokens); this model's context is "
            f"{max_context_len} tokens",
            param=PARAM,
        )
    if hidden_size > MAX_HIDDEN_SIZE:
        raise InvalidRequestError(
            f"prompt_embeds rows have {hidden_size} values; the most accepted is {MAX_HIDDEN_SIZE}",
            param=PARAM,
        )
    if not header.is_row_major():
        raise InvalidRequestError(
            f"prompt_embeds must be contiguous (row-major from its storage's start), got stride "
            f"{list(header.stride)} at offset {header.storage_offset} for shape "
            f"{list(header.shape)}",
            param=PARAM,
        )
    if header.storage.numel < header.numel:
        raise InvalidRequestError(
            f"prompt_embeds has {header.storage.numel} stored values for a shape of {header.numel}",
            param=PARAM,
        )
    return num_tokens, hidden_size
