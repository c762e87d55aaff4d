"""Chat messages and image bytes in, text out, all in one process.

The same steps the services split between them: render the chat template and
tokenize (tokenizer), decode and preprocess images (vision encoder), expand each
image placeholder to its token count, then prefill and decode (engine).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.types import SamplingParams
from services.engine.llm import EngineRequest, LLMEngine
from services.engine.model.rope import ImageSpan
from services.engine.processing import (
    ImageProcessor,
    TextProcessor,
    decode_image,
    validate_messages,
)

MAX_IMAGE_BYTES = 20 * 1024 * 1024


@dataclass(frozen=True)
class ChatResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    num_prompt_tokens: int


class OfflinePipeline:
    def __init__(self, text: TextProcessor, images: ImageProcessor, engine: LLMEngine) -> None:
        self.text = text
        self.images = images
        self.engine = engine
        self._ids = itertools.count()

    @classmethod
    def from_dir(cls, model_dir: str | Path, **engine_kwargs: Any) -> OfflinePipeline:
        return cls(
            TextProcessor.from_dir(model_dir),
            ImageProcessor.from_dir(model_dir),
            LLMEngine.from_dir(model_dir, **engine_kwargs),
        )

    def build_request(
        self,
        messages: list[dict[str, Any]],
        images: list[bytes],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> EngineRequest:
        """Tokenized request with one placeholder span and pixel tensor per image, in prompt order."""
        validate_messages(messages)
        ids = self.text.encode(self.text.render_chat(messages, add_generation_prompt=True))
        processed = [self.images.preprocess(decode_image(data, MAX_IMAGE_BYTES)) for data in images]
        counts = [self.images.num_image_tokens(p.grid_thw) for p in processed]
        ids, spans = self.text.expand_image_placeholders(ids, counts)
        return EngineRequest(
            request_id=request_id or f"offline-{next(self._ids)}",
            prompt_ids=ids,
            params=params,
            spans=[
                ImageSpan(s.offset, s.length, p.grid_thw)
                for s, p in zip(spans, processed, strict=True)
            ],
            pixel_values=[p.pixel_values for p in processed],
        )

    def chat(
        self, prompt: str, images: list[bytes], params: SamplingParams, system: str | None = None
    ) -> ChatResult:
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images] + [
            {"type": "text", "text": prompt}
        ]
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": content}
        ]
        request = self.build_request(messages, images, params)
        out = self.engine.generate([request])[0]
        return ChatResult(
            text=self.text.decode(out.token_ids, skip_special_tokens=True),
            token_ids=out.token_ids,
            finish_reason=out.finish_reason.value,
            num_prompt_tokens=out.num_prompt_tokens,
        )
