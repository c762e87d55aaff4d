"""The prefill prefix cache through the API: what a prompt reuses (``usage.prompt_tokens_details``)
and that its greedy output stays transformers' with the cache on.

Each test's texts and images are its own (seeded by its name), so it reuses only what its own
earlier requests left: the cached tokens a request reports are exactly the full pages it shares
with an earlier request of its test (same tokens and, over an image's placeholders, the same
image at the same place), never the page of its last token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from services.common.types import SamplingParams
from services.launch_config import LaunchConfig
from tests.conftest import image_bytes
from tests.e2e.openai_api.helpers import data_url
from tests.engine.test_model_parity import hf_inputs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PAGE = LaunchConfig.page_size  # the package's systems run up's default --page-size
MAX_TOKENS = 8
WORDS = (
    "river stone lamp cloud garden mirror quiet orange silver window harbor forest candle "
    "bridge meadow copper lantern valley whisper autumn velvet compass anchor thunder"
).split()
QUESTION = "What is shown in the picture?"


def text_of(name: str, num_words: int = 250) -> str:
    """A few hundred tokens of text that only ``name`` uses."""
    rng = random.Random(name)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def image_of(name: str) -> bytes:
    return image_bytes(120, 90, seed=random.Random(name).randrange(1 << 30))


def first_turn(system: str, question: str = QUESTION) -> list[dict]:
    """A system prompt, then one image (``{"type": "image"}``) and a question."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
    ]


def api_messages(messages: list[dict], images: list[bytes]) -> list[dict]:
    """``messages`` with each ``{"type": "image"}`` part the next of ``images`` as a data URL."""
    remaining = iter(images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": data_url(next(remaining))}}
                if part["type"] == "image"
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    assert next(remaining, None) is None
    return out


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of a conversation, and its prompt."""

    text: str
    prompt_ids: list[int]
    spans: list[tuple[int, int, bytes]]  # each image's (offset, length, bytes), in prompt order


def reference(pipeline, hf_model, messages: list[dict], images: list[bytes]) -> Reference:
    request = pipeline.build_request(messages, images, SamplingParams())
    with torch.no_grad():
        out = hf_model.generate(**hf_inputs(request), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(request.prompt_ids) :].tolist()
    spans = [(s.offset, s.length, image) for s, image in zip(request.spans, images, strict=True)]
    return Reference(
        pipeline.text.decode(tokens, skip_special_tokens=True), list(request.prompt_ids), spans
    )


def shared_tokens(prompt: Reference, earlier: Reference) -> int:
    """How many leading positions ``prompt`` shares with ``earlier``: equal tokens, and at an
    image's placeholders the same image bytes at the same place."""
    a, b = prompt.prompt_ids, earlier.prompt_ids
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    for span in prompt.spans:
        if span[0] < n and span not in earlier.spans:
            n = span[0]
    return n


def expected_cached(prompt: Reference, earlier: list[Reference]) -> int:
    """The tokens ``prompt`` reads from the cache after ``earlier`` were served: its full pages
    shared with one of them, short of the page holding its last token."""
    shared = max((shared_tokens(prompt, e) for e in earlier), default=0)
    return min(shared // PAGE, (len(prompt.prompt_ids) - 1) // PAGE) * PAGE


def ask(client, model_name, messages, images, expected: Reference, stream: bool = False):
    """The reply's text and usage; checks its prompt is the reference's."""
    call = dict(
        model=model_name,
        messages=api_messages(messages, images),
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if stream:
        chunks = list(
            client.chat.completions.create(
                **call, stream=True, stream_options={"include_usage": True}
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**call)
        text, usage = reply.choices[0].message.content, reply.usage
    assert usage.prompt_tokens == len(expected.prompt_ids)
    return text, usage


def cached(usage) -> tuple[int, int]:
    """(``cached_tokens``, ``cached_image_tokens``) of a reply's usage."""
    details = usage.prompt_tokens_details
    return details.cached_tokens, details.model_extra["cached_image_tokens"]


def test_second_turn_reads_the_first_turns_prompt_with_its_image(
    request, client, model_name, pipeline, hf_model
):
    image = image_of(request.node.name)
    turn1 = first_turn(text_of(request.node.name))
    ref1 = reference(pipeline, hf_model, turn1, [image])
    text1, usage1 = ask(client, model_name, turn1, [image], ref1)
    assert text1 == ref1.text
    assert cached(usage1) == (0, 0)

    turn2 = [
        *turn1,
        {"role": "assistant", "content": text1},
        {"role": "user", "content": "And what colour is it, mostly?"},
    ]
    ref2 = reference(pipeline, hf_model, turn2, [image])
    assert ref2.prompt_ids[: len(ref1.prompt_ids)] == ref1.prompt_ids
    want = expected_cached(ref2, [ref1])
    assert want == len(ref1.prompt_ids) // PAGE * PAGE
    (offset, length, _) = ref2.spans[0]
    assert 0 < offset + length <= want < len(ref2.prompt_ids)  # the image lies in cached pages

    text2, usage2 = ask(client, model_name, turn2, [image], ref2)
    assert text2 == ref2.text
    assert cached(usage2) == (want, length)

    # every full page of turn 2's own prompt is cached now, but the last token's
    again = expected_cached(ref2, [ref1, ref2])
    assert again == (len(ref2.prompt_ids) - 1) // PAGE * PAGE >= want
    for stream in (False, True):
        text, usage = ask(client, model_name, turn2, [image], ref2, stream=stream)
        assert text == ref2.text
        assert cached(usage) == (again, length)


def test_a_different_image_after_the_same_text_reuses_only_the_text_before_it(
    request, client, model_name, pipeline, hf_model
):
    name = request.node.name
    messages = first_turn(text_of(name))
    image_x, image_y = image_of(name + "/x"), image_of(name + "/y")
    assert image_x != image_y
    ref_x = reference(pipeline, hf_model, messages, [image_x])
    ref_y = reference(pipeline, hf_model, messages, [image_y])
    # equal token ids (the images are the same size): only the image bytes differ
    assert ref_x.prompt_ids == ref_y.prompt_ids

    text_x, usage_x = ask(client, model_name, messages, [image_x], ref_x)
    assert text_x == ref_x.text
    assert cached(usage_x) == (0, 0)

    text_y, usage_y = ask(client, model_name, messages, [image_y], ref_y)
    offset = ref_y.spans[0][0]
    want = expected_cached(ref_y, [ref_x])
    assert want == offset // PAGE * PAGE > 0  # the full pages before the image's first page
    assert text_y == ref_y.text
    assert cached(usage_y) == (want, 0)


def test_equal_image_bytes_after_a_different_prefix_reuse_nothing_of_the_image(
    request, client, model_name, pipeline, hf_model
):
    name = request.node.name
    image = image_of(name)
    lead = "Look closely at the shapes, the colours and the light in this picture, then answer: "
    text = text_of(name)
    first = first_turn(text, lead + "what is it?")
    ref_first = reference(pipeline, hf_model, first, [image])
    reply, usage = ask(client, model_name, first, [image], ref_first)
    assert reply == ref_first.text
    assert cached(usage) == (0, 0)

    # the same text but its last word, then the same image and question
    words = text.split()
    other = next(w for w in WORDS if w != words[-1])
    changed = first_turn(" ".join([*words[:-1], other]), lead + "what is it?")
    ref_changed = reference(pipeline, hf_model, changed, [image])
    offset = ref_changed.spans[0][0]
    want = expected_cached(ref_changed, [ref_first])
    assert 0 < want <= offset  # the text's pages before the changed word, none of the image
    reply, usage = ask(client, model_name, changed, [image], ref_changed)
    assert reply == ref_changed.text
    assert cached(usage) == (want, 0)

    # the first conversation's whole prefix and a different question: the image is reused
    same = first_turn(text, lead + "where was it taken?")
    ref_same = reference(pipeline, hf_model, same, [image])
    want = expected_cached(ref_same, [ref_first, ref_changed])
    (offset, length, _) = ref_same.spans[0]
    assert offset + length <= want
    reply, usage = ask(client, model_name, same, [image], ref_same)
    assert reply == ref_same.text
    assert cached(usage) == (want, length)
