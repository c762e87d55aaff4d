"""Domain types that cross service boundaries (inside the process; clients convert to protobuf).

All are frozen ``msgspec.Struct`` so they are cheap, typed and round-trip through
msgpack for tests and logs. Tensors never appear here.
"""

from __future__ import annotations

import enum

import msgspec


class TextPart(msgspec.Struct, frozen=True, tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image"):
    data: bytes  # the compressed image bytes (PNG, JPEG, ...), already fetched by the router


class ImageHeader(msgspec.Struct, frozen=True, tag="image_header"):
    """An image part as the tokenizer's worker processes see it: its hash and size, read in
    the server process, so the compressed bytes never cross into a worker and back."""

    content_hash: str
    height: int = 0
    width: int = 0
    error: str = ""  # why the header could not be read; raised where the image is tokenized


ContentPart = TextPart | ImagePart | ImageHeader


class ChatMessage(msgspec.Struct, frozen=True):
    role: str  # system | user | assistant
    content: tuple[ContentPart, ...]


class ImageSpanRef(msgspec.Struct, frozen=True):
    """An image's placeholder run in a prompt (request-global token offset)."""

    offset: int
    length: int
    content_hash: str  # SHA-256 hex of the compressed bytes
    grid_thw: tuple[int, int, int]  # patch grid before the 2x2 merge


class TokenizedPrompt(msgspec.Struct, frozen=True):
    token_ids: tuple[int, ...]
    spans: tuple[ImageSpanRef, ...] = ()
    images: dict[str, bytes] = {}  # content_hash -> compressed bytes, each distinct image once
    mrope_position_delta: int = 0
    # [len(token_ids), hidden] little-endian rows replacing the token embeddings (the token ids
    # are placeholders then); b"" = none
    prompt_embeds: bytes = b""
    prompt_embeds_dtype: str = ""  # "float32" | "bfloat16" | "float16" when prompt_embeds is set


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


class Usage(msgspec.Struct, frozen=True):
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_image_tokens: int = 0
