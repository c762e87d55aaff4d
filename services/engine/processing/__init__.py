"""Preprocessing shared by the tokenizer and vision encoder services: chat template,
tokenize/detokenize and placeholder expansion (``text``, ``chat``); image files: their size,
decode and content hash (``image_file``); patch grid and pixel preprocessing (``image``)."""

from services.engine.processing.chat import iter_image_parts, validate_messages
from services.engine.processing.image import (
    ImageProcessor,
    ImageProcessorConfig,
    ProcessedImage,
    pixel_hash,
    smart_resize,
)
from services.engine.processing.image_file import content_hash, decode_image
from services.engine.processing.text import (
    IncrementalDetokenizer,
    PlaceholderSpan,
    TextProcessor,
    expand_image_placeholders,
)

__all__ = [
    "ImageProcessor",
    "ImageProcessorConfig",
    "IncrementalDetokenizer",
    "PlaceholderSpan",
    "ProcessedImage",
    "TextProcessor",
    "content_hash",
    "decode_image",
    "expand_image_placeholders",
    "iter_image_parts",
    "pixel_hash",
    "smart_resize",
    "validate_messages",
]
