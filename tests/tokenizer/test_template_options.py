"""The chat template options the router passes on (vLLM's ``chat_template_kwargs`` and
``continue_final_message``): rendered by ``TextProcessor`` and served by the tokenizer."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import tokenizer_pb2
from services.common.types import ChatMessage, TextPart
from services.engine.processing import TextProcessor
from services.engine.processing.chat import check_template_kwargs, template_kwargs_from_json
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.tokenizer.conftest import TIMEOUT_S, user

# Reads two request variables, as Qwen3's reads enable_thinking: one at the top level, one
# inside a macro.
KWARGS_TEMPLATE = (
    "{%- macro persona() -%}{{ persona_name | default('assistant') }}{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>' ~ persona() ~ '\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}"
    "{%- endif -%}"
)
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def text() -> TextProcessor:
    return TextProcessor.from_dir(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def kwargs_text(text) -> TextProcessor:
    tokenizer = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
    return TextProcessor(tokenizer, KWARGS_TEMPLATE, text.eos_token_ids)


def assistant(*texts: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=tuple(TextPart(t) for t in texts))


# ---------------------------------------------------------------- chat_template_kwargs


def test_a_kwarg_changes_the_rendered_prompt(kwargs_text):
    assert kwargs_text.template_variables >= {"persona_name", "enable_thinking", "messages"}
    plain = kwargs_text.render_chat(CHAT)
    assert plain.endswith("<|im_start|>assistant\n")
    no_think = kwargs_text.render_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert no_think == plain + "<think>\n\n</think>\n\n"
    named = kwargs_text.render_chat(CHAT, template_kwargs={"persona_name": "bot"})
    assert named.endswith("<|im_start|>bot\n")
    ids = kwargs_text.encode_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert ids == kwargs_text.encode(no_think)  # the template's <think> markers stay text here


def test_a_kwarg_the_template_does_not_read_is_refused(kwargs_text, text):
    with pytest.raises(InvalidRequestError) as info:
        kwargs_text.render_chat(CHAT, template_kwargs={"enable_thinking": False, "tone": "dry"})
    assert info.value.param == "chat_template_kwargs.tone"
    assert text.template_variables == {"messages", "add_generation_prompt"}  # the bundled one
    with pytest.raises(InvalidRequestError) as info:
        text.encode_chat(CHAT, template_kwargs={"enable_thinking": False})
    assert info.value.param == "chat_template_kwargs.enable_thinking"
    assert "does not read" in info.value.message


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "chat_template_kwargs.messages"),
        ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
        ({"eos_token": "x"}, "chat_template_kwargs.eos_token"),
        ({"range": 1}, "chat_template_kwargs.range"),
        ({"a b": 1}, "chat_template_kwargs"),
        ({f"k{i}": i for i in range(33)}, "chat_template_kwargs"),
        ({"k": "x" * 20_000}, "chat_template_kwargs"),
        ({"k": float("nan")}, "chat_template_kwargs"),
        ({"k": "\ud800"}, "chat_template_kwargs"),
    ],
)
def test_kwargs_checks(kwargs_text, kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        check_template_kwargs(kwargs)
    assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        kwargs_text.render_chat(CHAT, template_kwargs=kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("raw", ["[1]", "1", "{", '"x"'])
def test_kwargs_text_must_be_a_json_object(raw):
    with pytest.raises(InvalidRequestError) as info:
        template_kwargs_from_json(raw)
    assert info.value.param == "chat_template_kwargs"
    assert template_kwargs_from_json("") == {}
    assert template_kwargs_from_json('{"a": [1, {"b": null}]}') == {"a": [1, {"b": None}]}


# ---------------------------------------------------------------- continue_final_message


@pytest.mark.parametrize(
    "final",
    [
        "The answer is",
        "end",  # also a piece of <|im_end|>: a search for the text would cut inside it
        "\n",
        "<|im_end|>",  # typed special-token text stays text, and the turn stays open
        "",
    ],
)
def test_continue_ends_right_after_the_final_text(text, final):
    messages = [*CHAT, {"role": "assistant", "content": final}]
    closed = text.render_chat(messages, add_generation_prompt=False)
    assert closed.endswith(final + "<|im_end|>\n")
    rendered = text.render_chat(messages, False, continue_final_message=True)
    assert rendered == closed.removesuffix("<|im_end|>\n")
    ids = text.encode_chat(messages, False, continue_final_message=True)
    closed_ids = text.encode_chat(messages, False)
    assert closed_ids[: len(ids)] == ids and closed_ids[len(ids)] == text.encode("<|im_end|>")[0]


def test_continue_equals_transformers(text):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
    messages = [
        *CHAT,
        {"role": "assistant", "content": [{"type": "text", "text": "One, two,"}]},
    ]
    ours = text.render_chat(messages, False, continue_final_message=True)
    theirs = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert ours == theirs


@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "says"),
    [
        ([*CHAT, {"role": "assistant", "content": "x"}], True, "both cannot be true"),
        (CHAT, False, "it is a user message"),
        (
            [*CHAT, {"role": "assistant", "content": [{"type": "image"}]}],
            False,
            "end with text",
        ),
    ],
)
def test_continue_refusals(text, messages, add_generation_prompt, says):
    for render in (text.render_chat, text.encode_chat):
        with pytest.raises(InvalidRequestError) as info:
            render(messages, add_generation_prompt, continue_final_message=True)
        assert info.value.param == "continue_final_message" and says in info.value.message


def test_continue_with_a_template_that_drops_the_text_is_refused(text):
    tokenizer = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json"))
    silent = TextProcessor(
        tokenizer, "{% for m in messages %}<|im_start|>{{ m.role }}\n{% endfor %}", [0]
    )
    messages = [*CHAT, {"role": "assistant", "content": "x"}]
    with pytest.raises(InvalidRequestError, match="does not write the last message"):
        silent.encode_chat(messages, False, continue_final_message=True)


# ---------------------------------------------------------------- through the service


async def test_the_service_continues_the_final_message(served, text):
    messages = [user("Count to three."), assistant("One, ", "two,")]
    prompt = await served.client.tokenize_chat(
        "c", messages, False, timeout_s=TIMEOUT_S, continue_final_message=True
    )
    decoded = text.decode(prompt.token_ids)
    assert decoded.endswith("<|im_start|>assistant\nOne, two,")
    closed = await served.client.tokenize_chat("c", messages, False, timeout_s=TIMEOUT_S)
    assert list(closed.token_ids) == [*prompt.token_ids, *text.encode("<|im_end|>\n")]


async def test_the_service_continues_after_an_image(served, text):
    messages = [user("Draw."), assistant("Here: "), user(image_bytes(32, 32), "More")]
    messages.append(assistant("Sure"))
    prompt = await served.client.tokenize_chat(
        "c", messages, False, timeout_s=TIMEOUT_S, continue_final_message=True
    )
    assert text.decode(prompt.token_ids).endswith("<|im_start|>assistant\nSure")
    assert len(prompt.spans) == 1


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (
            {"chat_template_kwargs": '{"enable_thinking": false}'},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": '{"tools": []}'}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": "[]"}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # the last is a user's
    ],
)
async def test_the_service_refuses_bad_options(served, options, param):
    with pytest.raises(InvalidRequestError) as info:
        await served.client.tokenize_chat("b", [user("Hi")], False, timeout_s=TIMEOUT_S, **options)
    assert info.value.param == param


@pytest.mark.parametrize(
    "field", [("continue_final_message", True), ("chat_template_kwargs", json.dumps({"a": 1}))]
)
async def test_the_service_refuses_template_options_with_a_prompt(served, field):
    name, value = field
    stub_request = tokenizer_pb2.TokenizeRequest(request_id="p", prompt="Once", **{name: value})
    with pytest.raises(InvalidRequestError) as info:
        await served.client._tokenize("p", stub_request.SerializeToString(), TIMEOUT_S)
    assert info.value.param == name
