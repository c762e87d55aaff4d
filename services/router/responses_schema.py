"""Request bodies of the Responses API (``POST /v1/responses``), parsed as chat's are
(``openai_schema.py``): strict types, unknown fields a 400 naming them, and every OpenAI field
this server cannot honour refused with a message saying so (``REFUSALS``).

``input`` items, their content parts and ``tools`` come in several shapes told apart by
``type``; ``responses_input.py`` checks each against its model here, so that an unsupported
type is a 400 saying so rather than a field-by-field mismatch.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, StrictBool, StrictFloat, StrictInt, StrictStr

from services.router.openai_schema import Body, Refusal


def _unset(value: Any) -> bool:
    return value is None


class InputTextPart(Body):
    type: StrictStr  # input_text
    text: StrictStr


class OutputTextPart(Body):
    """An earlier output's text, sent back in an assistant message; its annotations and
    logprobs describe that output and do not change the prompt."""

    type: StrictStr  # output_text
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImagePart(Body):
    type: StrictStr  # input_image
    image_url: StrictStr | None = None  # a data URL or an http(s) URL
    file_id: StrictStr | None = None  # refused: there is no files API here
    detail: StrictStr | None = None  # auto or high; low (a downscaled image) is refused


class MessageItem(Body):
    """A message in ``input``; ``id`` and ``status`` come with an earlier output sent back."""

    type: StrictStr | None = None  # message
    role: StrictStr  # user, assistant, system or developer
    content: StrictStr | list[dict[str, Any]]
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallItem(Body):
    """An earlier output's function call, sent back in ``input``."""

    type: StrictStr  # function_call
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # a JSON object's text
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionCallOutputItem(Body):
    """The result of the function call ``call_id`` names."""

    type: StrictStr  # function_call_output
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class FunctionToolBody(Body):
    """A function tool in the Responses API's flat shape."""

    type: StrictStr  # function
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class TextFormatBody(Body):
    """``text.format``: text, json_object, or json_schema with its name and schema."""

    type: StrictStr
    name: StrictStr | None = None
    # "schema" as sent (pydantic's BaseModel has a schema attribute the field must not shadow)
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None


class TextBody(Body):
    format: TextFormatBody | None = None
    verbosity: StrictStr | None = None  # refused


# OpenAI keeps at most 16 metadata pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_LEN, MAX_METADATA_VALUE_LEN = 16, 64, 512


class ResponsesBody(Body):
    """``POST /v1/responses``: served as a chat request (``responses_input.py``). Nothing is
    stored: ``store`` is taken absent or false and the response says ``store: false``."""

    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        (
            "store",
            lambda v: not v,
            "responses are not stored here, so none could be retrieved or continued; "
            "send store: false or leave it out",
        ),
        (
            "previous_response_id",
            _unset,
            "responses are not stored here; send the whole conversation in input",
        ),
        (
            "conversation",
            _unset,
            "conversations are not stored here; send the whole conversation in input",
        ),
        ("background", lambda v: not v, "background responses are not supported"),
        ("reasoning", _unset, "reasoning is not supported (the model does not reason)"),
        ("prompt", _unset, "prompt templates are not supported"),
        ("max_tool_calls", _unset, "max_tool_calls bounds built-in tools, which are not supported"),
        (
            "truncation",
            lambda v: v in (None, "disabled"),
            "only truncation: disabled is supported (an input over the context is a 400)",
        ),
        ("prompt_cache_key", _unset, "prompt_cache_key is not supported"),
        ("prompt_cache_retention", _unset, "prompt_cache_retention is not supported"),
        (
            "stream_options",
            lambda v: v in (None, {}, {"include_obfuscation": False}),
            "stream obfuscation is not supported; send include_obfuscation: false",
        ),
    )
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None  # a system message before the input
    max_output_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stream: StrictBool = False
    text: TextBody | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (FunctionToolBody)
    tool_choice: StrictStr | dict[str, Any] | None = None  # none / auto / required / named
    parallel_tool_calls: StrictBool | None = None
    include: list[StrictStr] | None = None  # only message.output_text.logprobs
    top_logprobs: StrictInt | None = None  # 0..20; needs include's logprobs
    metadata: dict[StrictStr, StrictStr] | None = None  # echoed in the response
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict[str, Any] | None = None
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: StrictInt | None = None
    truncation: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_retention: StrictStr | None = None
    stream_options: dict[str, Any] | None = None
