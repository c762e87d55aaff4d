"""Synthetic chat-completion requests for the serving benchmark.

Prompts are random words from a fixed list of common English words, one word per
requested input token: most BPE vocabularies encode each as a single token (with its
leading space), so the prompt is close to the requested length plus the chat template's
few tokens. The server's ``usage.prompt_tokens`` is what gets reported.

Images are PNGs generated in memory (no Pillow needed), different for every request
and image slot so that embedding or prefix caches on the server cannot hit.
"""

from __future__ import annotations

import base64
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record "
    "paper space ground form event official matter center couple site project activity star table need "
    "court oil situation cost industry figure street image phone data picture practice piece land "
    "product doctor wall patient worker news test movie north love support technology step baby "
    "computer type attention film tree source organization hair window evidence population "
    "blue green red small large early young important few public bad same able long great little own "
    "other old big high different local sure free better true whole real best hard major clear late"
).split()


@dataclass(frozen=True)
class IntRange:
    """An inclusive integer range; ``low == high`` is a fixed value."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> IntRange:
        """``"N"`` (fixed) or ``"a:b"`` (uniform over a..b inclusive)."""
        low, _, high = text.partition(":")
        bounds = cls(int(low), int(high or low))
        if bounds.low < 0 or bounds.high < bounds.low:
            raise ValueError(f"bad range {text!r}: need 0 <= a <= b")
        return bounds

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    input_len: IntRange
    output_len: IntRange
    num_images: IntRange
    image_size: tuple[int, int]  # (width, height)
    ignore_eos: bool
    temperature: float


@dataclass(frozen=True)
class RequestSpec:
    """One request, encoded before the run starts so encoding never sits inside a timing."""

    index: int
    input_len: int  # words in the prompt (requested tokens)
    output_len: int  # max_tokens
    num_images: int
    body: bytes  # the JSON body


def parse_size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    size = (int(width), int(height))
    if min(size) <= 0:
        raise ValueError(f"bad image size {text!r}: need WxH with W, H > 0")
    return size


def synth_prompt(num_words: int, rng: np.random.Generator) -> str:
    picks = rng.integers(0, len(WORDS), size=num_words)
    return " ".join(WORDS[i] for i in picks)


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A deterministic RGB PNG: seed-shifted gradients, with the seed written into the first pixels."""
    x, y = np.arange(width), np.arange(height)[:, None]
    pixels = np.empty((height, width, 3), np.uint8)  # [height, width, 3] uint8
    pixels[:, :, 0] = (x + seed * 7) % 256
    pixels[:, :, 1] = (y + seed * 13) % 256
    pixels[:, :, 2] = ((x // 8 + y // 8) * (seed % 31 + 1)) % 256
    seed_bytes = np.frombuffer(struct.pack(">Q", seed), dtype=np.uint8)
    flat = pixels.reshape(-1)
    flat[: min(len(flat), len(seed_bytes))] = seed_bytes[: len(flat)]
    scan = pixels.reshape(height, width * 3)
    sub = scan.copy()
    # PNG "Sub" filter: each byte minus the same channel's left neighbour (mod 256)
    sub[:, 3:] -= scan[:, :-3]
    rows = np.concatenate([np.ones((height, 1), np.uint8), sub], axis=1)  # filter type 1 on every row
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(rows.tobytes(), 1))
        + _png_chunk(b"IEND", b"")
    )


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_data_url(width: int, height: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode("ascii")


def chat_body(
    model: str, prompt: str, image_urls: list[str], max_tokens: int, workload: WorkloadSpec
) -> dict:
    if image_urls:
        content: str | list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
        content.append({"type": "text", "text": prompt})
    else:
        content = prompt  # plain string: accepted by every OpenAI-compatible server, even text-only ones
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": workload.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True  # extension accepted by vLLM, SGLang and stageserve
    return body


def make_requests(model: str, workload: WorkloadSpec, num_requests: int, seed: int) -> list[RequestSpec]:
    """All requests of a run, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    width, height = workload.image_size
    max_images = max(workload.num_images.high, 1)
    specs = []
    for index in range(num_requests):
        input_len = workload.input_len.sample(rng)
        output_len = workload.output_len.sample(rng)
        num_images = workload.num_images.sample(rng)
        urls = [
            png_data_url(width, height, seed * 1_000_003 + index * max_images + j) for j in range(num_images)
        ]
        body = chat_body(model, synth_prompt(input_len, rng), urls, output_len, workload)
        specs.append(RequestSpec(index, input_len, output_len, num_images, json.dumps(body).encode()))
    return specs


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process at ``request_rate``; all 0 when infinite."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed + 1)
    gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()
