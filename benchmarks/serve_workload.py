"""The serving benchmark's requests: prompts, images and the JSON bodies of either backend.

Backends (vLLM's names): ``openai-chat`` posts to ``/chat/completions`` (images as data
URLs before the text, the prompt as the user message), ``openai`` to ``/completions``
(the prompt as is: no chat template, no images). Every body streams with
``stream_options.include_usage`` (unless ``stream`` is off: one JSON reply with its usage), so
the server's token counts are what gets reported; ``extra_body`` (``--extra-body``) is merged
into every body last, so it may add fields or override the client's (vLLM's ``--extra-body``).
Prompts come from ``serve_dataset`` (exact token lengths, ShareGPT, or shared prefixes),
images from ``serve_images``; everything is built before the clock starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import numpy as np

from benchmarks.serve_dataset import (
    MooncakeTraceSpec,
    MultiTurnSpec,
    PrefixRepetitionSpec,
    PromptSpec,
    ShareGptSpec,
    mooncake_prompts,
    prefix_repetition_prompts,
    random_prompts,
    sharegpt_prompts,
)
from benchmarks.serve_images import image_data_url
from benchmarks.serve_tokens import TokenCounter

BACKENDS = ("openai-chat", "openai")
ENDPOINTS = {"openai-chat": "/chat/completions", "openai": "/completions"}


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
    input_len: IntRange  # prompt text tokens (random prompts)
    output_len: IntRange  # max_tokens (random prompts)
    num_images: IntRange
    image_size: tuple[int, int]  # (width, height)
    ignore_eos: bool
    temperature: float
    backend: str = "openai-chat"
    image_kind: str = "noise"
    image_format: str = "jpeg"
    # None: random prompts of input_len tokens
    dataset: ShareGptSpec | PrefixRepetitionSpec | MultiTurnSpec | MooncakeTraceSpec | None = None
    stream: bool = True
    extra_body: dict = field(default_factory=dict)  # merged into every request body last


@dataclass(frozen=True)
class RequestSpec:
    """One request, encoded before the run starts so encoding never sits inside a timing."""

    index: int
    input_len: (
        int  # prompt text tokens, counted with the model's tokenizer (chat template not included)
    )
    output_len: int  # max_tokens
    num_images: int
    body: bytes  # the JSON body; a later turn's holds only its own user message
    is_streamed: bool = True
    conversation: int | None = None  # multi-turn: which conversation (None: independent)
    turn: int = 0
    arrival_s: float | None = None  # a trace's send time; None: the arrival schedule's


def follow_up(previous_body: bytes, reply: str, spec: RequestSpec) -> RequestSpec:
    """A later turn as sent: the previous turn's messages, its reply as the assistant's
    message, then this turn's user message."""
    previous, body = json.loads(previous_body), json.loads(spec.body)
    assistant = {"role": "assistant", "content": reply}
    body["messages"] = [*previous["messages"], assistant, *body["messages"]]
    return replace(spec, body=json.dumps(body).encode())


def chat_body(
    model: str, prompt: str, image_urls: list[str], max_tokens: int, workload: WorkloadSpec
) -> dict:
    if image_urls:
        content: str | list[dict] = [
            {"type": "image_url", "image_url": {"url": u}} for u in image_urls
        ]
        content.append({"type": "text", "text": prompt})
    else:
        content = (
            prompt  # plain string: accepted by every OpenAI-compatible server, even text-only ones
        )
    body = {"model": model, "messages": [{"role": "user", "content": content}]}
    return _sampled(body, max_tokens, workload)


def completion_body(model: str, prompt: str, max_tokens: int, workload: WorkloadSpec) -> dict:
    return _sampled({"model": model, "prompt": prompt}, max_tokens, workload)


def _sampled(body: dict, max_tokens: int, workload: WorkloadSpec) -> dict:
    body.update(max_tokens=max_tokens, temperature=workload.temperature, stream=workload.stream)
    if workload.stream:
        body["stream_options"] = {"include_usage": True}
    if workload.ignore_eos:
        body["ignore_eos"] = True  # extension accepted by vLLM, SGLang and stageserve
    body.update(workload.extra_body)
    return body


async def make_requests(
    model: str, workload: WorkloadSpec, num_requests: int, seed: int, counter: TokenCounter
) -> list[RequestSpec]:
    """All requests of a run, deterministic in ``seed`` (and the tokenizer)."""
    rng = np.random.default_rng(seed)
    w = workload
    lengths = [
        (w.input_len.sample(rng), w.output_len.sample(rng), w.num_images.sample(rng))
        for _ in range(num_requests)
    ]
    multi_turn = workload.dataset if isinstance(workload.dataset, MultiTurnSpec) else None
    if multi_turn is not None:  # images in each conversation's first turn only
        turns = multi_turn.num_turns
        lengths = [
            (multi_turn.turn_len, multi_turn.output_len, n if i % turns == 0 else 0)
            for i, (_, _, n) in enumerate(lengths)
        ]
    if isinstance(workload.dataset, ShareGptSpec):
        prompts = await sharegpt_prompts(workload.dataset, num_requests, seed, counter)
    elif isinstance(workload.dataset, MooncakeTraceSpec):
        prompts = await mooncake_prompts(workload.dataset, num_requests, seed, counter)
    elif isinstance(workload.dataset, PrefixRepetitionSpec):
        prompts = await prefix_repetition_prompts(workload.dataset, num_requests, rng, counter)
    else:
        prompts = await random_prompts(
            [n for n, _, _ in lengths], [m for _, m, _ in lengths], rng, counter
        )
    max_images = max(workload.num_images.high, 1)
    specs = []
    for index, (prompt, (_, _, num_images)) in enumerate(zip(prompts, lengths, strict=True)):
        image_seeds = [seed * 1_000_003 + index * max_images + j for j in range(num_images)]
        body = _body(model, prompt, image_seeds, workload)
        encoded = json.dumps(body).encode()
        spec = RequestSpec(
            index,
            prompt.input_len,
            prompt.output_len,
            num_images,
            encoded,
            workload.stream,
            arrival_s=prompt.arrival_s,
        )
        if multi_turn is not None:
            turns = multi_turn.num_turns
            spec = replace(spec, conversation=index // turns, turn=index % turns)
        specs.append(spec)
    return specs


def _body(model: str, prompt: PromptSpec, image_seeds: list[int], workload: WorkloadSpec) -> dict:
    if workload.backend == "openai":
        assert not image_seeds, "the openai (completions) backend sends no images"
        return completion_body(model, prompt.text, prompt.output_len, workload)
    width, height = workload.image_size
    urls = [
        image_data_url(workload.image_kind, workload.image_format, width, height, s)
        for s in image_seeds
    ]
    return chat_body(model, prompt.text, urls, prompt.output_len, workload)


def arrival_offsets(
    num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0
) -> list[float]:
    """Send times in seconds from the start, all 0 when ``request_rate`` is infinite; else gaps
    drawn from a gamma distribution of mean ``1 / request_rate`` and shape ``burstiness``
    (vLLM's ``--burstiness``): 1 is a Poisson process, lower is burstier, higher steadier."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed + 1)
    if burstiness == 1.0:  # the exponential draws of a Poisson run stay as they were
        gaps = rng.exponential(1.0 / request_rate, size=num_requests)
    else:
        gaps = rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num_requests)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()
