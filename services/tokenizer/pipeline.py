"""All CPU work of one Tokenize call: chat or prompt in, ``TokenizedPrompt`` out.

Chat: render the template with the messages' texts kept as plain text
(``TextProcessor.encode_chat``), read each distinct image's size from its header to
find its patch grid (no pixel decode: the vision encoder decodes the same bytes, and
refuses a file whose pixel data is cut short), hash its compressed bytes, expand each
placeholder to the image's token count, and compute the M-RoPE position delta. Images
leave as their compressed bytes, each distinct one once. An image may come as an
``ImageHeader`` instead (its hash and size read beforehand: ``image_header`` in the
server process, or the router, ``header_from_input``); then its entry in
``TokenizedPrompt.images`` is empty and the caller holds the bytes.

The context limit is checked on the text first, with work bounded by the limit: a
prompt or chat that certainly needs ``max_model_len`` tokens or more is refused before
it is tokenized whole and before any image is decoded (``TextProcessor.encode`` with
``max_len``), and once more after the image placeholders are expanded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import (
    ChatMessage,
    ImageHeader,
    ImagePart,
    ImageSpanRef,
    TextPart,
    TokenizedPrompt,
)
from services.engine.config import ModelConfig
from services.engine.model.spans import ImageSpan, rope_delta
from services.engine.processing import ImageProcessor, TextProcessor, content_hash
from services.engine.processing.image_file import (
    check_num_bytes,
    check_num_pixels,
    header_size,
    image_size,
)
from services.engine.processing.text import prompt_too_long
from services.tokenizer.config import Limits

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class TokenizePipeline:
    """Tokenizes chats and raw prompts for one checkpoint under one set of limits."""

    def __init__(self, text: TextProcessor, images: ImageProcessor, limits: Limits) -> None:
        self.text = text
        self.images = images
        self.limits = limits

    @classmethod
    def from_dir(cls, model_dir: str | Path, limits: Limits) -> TokenizePipeline:
        return cls(TextProcessor.from_dir(model_dir), ImageProcessor.from_dir(model_dir), limits)

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenizedPrompt:
        """Token ids with expanded placeholders, one span per image part, distinct images' bytes.
        ``continue_final_message`` and ``template_kwargs``: ``TextProcessor.render_chat``'s."""
        template_messages, image_parts = _template_messages(messages)
        # The text is checked before any image is decoded: each image only adds tokens.
        ids = self.text.encode_chat(
            template_messages,
            add_generation_prompt,
            self.limits.max_model_len,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
        )
        grids: dict[str, tuple[int, int, int]] = {}  # content hash -> patch grid
        images: dict[str, bytes] = {}  # content hash -> compressed bytes, first appearance first
        hashes = []
        for param, part in image_parts:
            key = part.content_hash if isinstance(part, ImageHeader) else content_hash(part.data)
            if key not in grids:
                grids[key] = self._grid(part, param)
                images[key] = b"" if isinstance(part, ImageHeader) else part.data
            hashes.append(key)
        counts = [self.images.num_image_tokens(grids[key]) for key in hashes]
        ids, placeholders = self.text.expand_image_placeholders(ids, counts)
        if len(ids) >= self.limits.max_model_len:
            raise prompt_too_long(len(ids), self.limits.max_model_len, "messages")
        spans = tuple(
            ImageSpanRef(offset=p.offset, length=p.length, content_hash=key, grid_thw=grids[key])
            for p, key in zip(placeholders, hashes, strict=True)
        )
        return TokenizedPrompt(
            token_ids=tuple(ids),
            spans=spans,
            images=images,
            mrope_position_delta=self._rope_delta(len(ids), spans),
        )

    def tokenize_prompt(self, prompt: str) -> TokenizedPrompt:
        """Token ids of a raw prompt; special-token strings in it are parsed (no template here)."""
        ids = self.text.encode(prompt, self.limits.max_model_len)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        vision_ids = {self.text.image_token_id, self.text.video_token_id}
        if any(token_id in vision_ids for token_id in ids):
            raise InvalidRequestError(
                "prompt contains an image or video placeholder token; raw prompts carry no images "
                "(send images as chat messages)",
                param="prompt",
            )
        return TokenizedPrompt(token_ids=tuple(ids))

    def _grid(self, part: ImagePart | ImageHeader, param: str) -> tuple[int, int, int]:
        try:
            if isinstance(part, ImageHeader):
                if part.error:
                    raise InvalidRequestError(part.error)
                return self.images.grid_for_size(part.height, part.width)
            height, width = image_size(
                part.data, self.limits.max_image_bytes, self.limits.max_image_pixels
            )
            return self.images.grid_for_size(height, width)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{param}: {exc.message}", param=param) from exc

    def _rope_delta(self, num_tokens: int, spans: Sequence[ImageSpanRef]) -> int:
        if not spans:
            return 0
        rope_spans = [ImageSpan(s.offset, s.length, s.grid_thw) for s in spans]
        return rope_delta(num_tokens, rope_spans, self.images.config.merge_size)


def image_header(data: bytes, limits: Limits) -> ImageHeader | None:
    """The hash and size of one image part from its header, or why the header cannot be read
    (raised when the part is tokenized, where the bytes' own check would raise it); None
    where only a full decode tells the size (that stays the worker's job)."""
    try:
        size = header_size(data, limits.max_image_bytes, limits.max_image_pixels)
    except InvalidRequestError as exc:
        return ImageHeader(content_hash(data), error=exc.message)
    if size is None:
        return None
    return ImageHeader(content_hash(data), *size)


def header_from_input(
    content_hash: str, height: int, width: int, num_bytes: int, limits: Limits
) -> ImageHeader:
    """An image part given by its header (a caller read it: the router), with ``image_header``'s
    limit checks: over a limit, the header carries the error that the bytes would raise."""
    try:
        if not _SHA256_HEX.fullmatch(content_hash):
            raise InvalidRequestError(
                f"image content_hash must be 64 lower-case hex digits, got {content_hash[:80]!r}"
            )
        if height <= 0 or width <= 0:
            raise InvalidRequestError(f"image size must be positive, got {width}x{height}")
        check_num_bytes(num_bytes, limits.max_image_bytes)
        check_num_pixels(width, height, limits.max_image_pixels)
    except InvalidRequestError as exc:
        return ImageHeader(content_hash, error=exc.message)
    return ImageHeader(content_hash, height, width)


def _template_messages(
    messages: Sequence[ChatMessage],
) -> tuple[list[dict[str, Any]], list[tuple[str, ImagePart | ImageHeader]]]:
    """The chat as the template sees it (image parts become ``{"type": "image"}``), and the
    image parts' (param, part) in prompt order."""
    if not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", param="messages")
    rendered: list[dict[str, Any]] = []
    image_parts: list[tuple[str, ImagePart | ImageHeader]] = []
    for i, message in enumerate(messages):
        if not message.content:
            raise InvalidRequestError(
                f"messages[{i}].content is missing", param=f"messages[{i}].content"
            )
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                parts.append({"type": "text", "text": part.text})
            else:
                assert isinstance(part, ImagePart | ImageHeader), type(part)
                parts.append({"type": "image"})
                image_parts.append((f"messages[{i}].content[{j}]", part))
        rendered.append({"role": message.role, "content": parts})
    return rendered, image_parts


def max_model_len_of(model_dir: str | Path) -> int:
    """The checkpoint's context length (``max_position_embeddings``)."""
    return ModelConfig.from_dir(model_dir).text.max_position_embeddings
