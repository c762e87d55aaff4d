"""Schema-driven: every field the chat and text completion bodies accept has an effect a named
test shows, is a documented no-op (the README names it and the schema's comment says why), or
is refused past the values that ask for what the server does (``REFUSALS``). A field added to
the bodies without one of these fails here, so nothing is accepted and silently ignored."""

from __future__ import annotations

import ast

import pytest

from services.router.openai_schema import ChatCompletionBody, CompletionBody
from tests.conftest import REPO

TESTS = REPO / "tests"

# field -> a test that shows what it does ("file::function"), both bodies unless keyed per body
EFFECTS: dict[str, str] = {
    "model": "router/test_http_errors.py::test_an_empty_or_omitted_model_is_the_served_one",
    "max_tokens": "router/test_http_api.py::test_max_tokens_gives_length",
    "max_completion_tokens": "router/test_http_api.py::test_max_tokens_gives_length",
    "temperature": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "top_p": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "top_k": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "min_p": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "seed": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "frequency_penalty": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "presence_penalty": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "repetition_penalty": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "ignore_eos": "router/test_http_api.py::test_sampling_params_reach_decode_and_prefill",
    "stop": "router/test_http_streaming.py::test_stop_strings",
    "n": "router/test_choices.py::test_chat_choices_share_the_prompt_and_sum_the_completions",
    "stream": "router/test_http_streaming.py::test_stream_chat",
    "stream_options": "router/test_http_streaming.py::test_stream_chat_with_usage",
    "logit_bias": "e2e/openai_api/test_parameters.py::test_logit_bias_forces_and_bans_tokens",
    "min_tokens": "e2e/openai_api/test_parameters.py::test_min_tokens_delays_a_forced_eos",
    "stop_token_ids": (
        "e2e/openai_api/test_parameters.py::test_stop_token_ids_end_generation_and_are_not_shown"
    ),
    "response_format": (
        "e2e/openai_api/test_structured_outputs.py::test_json_schemas_hold_at_temperature_one"
    ),
    "structured_outputs": (
        "router/test_structured_extensions.py::"
        "test_each_constraint_reaches_prefill_and_decode_as_its_grammar"
    ),
    "guided_json": "router/test_structured_extensions.py::"
    "test_guided_fields_mean_what_structured_outputs_fields_mean",
    "guided_regex": "router/test_structured_extensions.py::"
    "test_guided_fields_mean_what_structured_outputs_fields_mean",
    "guided_choice": "router/test_structured_extensions.py::"
    "test_guided_fields_mean_what_structured_outputs_fields_mean",
    "guided_grammar": "router/test_structured_extensions.py::"
    "test_guided_fields_mean_what_structured_outputs_fields_mean",
    "skip_special_tokens": (
        "router/test_chat_template_fields.py::test_skip_special_tokens_false_keeps_their_text"
    ),
    "messages": "router/test_http_api.py::test_chat_completion",
    "logprobs": "router/test_openai_logprobs.py::test_logprobs_reach_prefill_and_decode",
    "top_logprobs": "router/test_openai_logprobs.py::test_logprobs_reach_prefill_and_decode",
    "tools": "router/test_tools.py::test_auto_returns_parsed_calls_and_lists_the_tools",
    "tool_choice": "router/test_tools.py::test_tool_choice_none_returns_text",
    "parallel_tool_calls": (
        "router/test_tools.py::test_hermes_parser_keeps_later_calls_as_text_when_not_parallel"
    ),
    "add_generation_prompt": (
        "router/test_chat_template_fields.py::test_add_generation_prompt_false_alone"
    ),
    "continue_final_message": (
        "router/test_chat_template_fields.py::test_template_fields_reach_the_tokenizer"
    ),
    "chat_template_kwargs": (
        "router/test_chat_template_fields.py::test_template_fields_reach_the_tokenizer"
    ),
    "prompt": "router/test_completion_prompts.py::test_token_ids_go_to_prefill_as_they_are",
    "prompt_embeds": "router/test_prompt_embeds.py::"
    "test_prompt_embeds_reach_prefill_as_rows_without_the_tokenizer",
    "echo": "router/test_openai_logprobs.py::test_echo_puts_the_prompt_before_the_output",
    "prompt_logprobs": "router/test_openai_logprobs.py::test_prompt_logprobs_reach_prefill",
}
# fields that change nothing here, on purpose, each named in the README's field list
NO_OPS = {"user", "safety_identifier", "spaces_between_special_tokens"}


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    tree = ast.parse((TESTS / path).read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize("body", [ChatCompletionBody, CompletionBody], ids=["chat", "completions"])
def test_every_accepted_field_has_an_effect_a_test_shows_or_is_a_documented_no_op(body) -> None:
    refused = {name for name, _, _ in body.REFUSALS}
    unclassified = [
        field
        for field in body.model_fields
        if field not in EFFECTS and field not in NO_OPS and field not in refused
    ]
    assert not unclassified, f"fields with no named effect, no-op or refusal: {unclassified}"


@pytest.mark.parametrize("field", sorted(EFFECTS))
def test_each_named_effect_is_a_test_that_exists(field) -> None:
    assert _test_exists(EFFECTS[field]), EFFECTS[field]


@pytest.mark.parametrize("field", sorted(NO_OPS))
def test_each_no_op_is_in_the_readme_field_list(field) -> None:
    assert f"`{field}`" in (REPO / "README.md").read_text(), field
    assert field in ChatCompletionBody.model_fields and field in CompletionBody.model_fields


def test_the_lists_name_only_fields_the_bodies_have() -> None:
    fields = set(ChatCompletionBody.model_fields) | set(CompletionBody.model_fields)
    assert not (set(EFFECTS) | NO_OPS) - fields
