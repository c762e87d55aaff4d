"""OpenAI request bodies (pydantic, parsed by FastAPI) and the checks every endpoint shares.

Shape errors (missing or mistyped fields) are FastAPI's validation errors; range and
consistency errors are ``InvalidRequestError`` raised with the offending ``param``.
Types are strict: a boolean is ``true``/``false``, an integer is an integer (not ``1.0``,
``"1"`` or ``true``); a number field takes integers too.

Nothing a client sends is ignored. A field this server does not know is refused with a
400 naming it, as OpenAI does (vLLM logs and ignores them instead): a client that sends
a field expects its effect, and an ignored one gives a 200 without it. Every field
OpenAI defines is either honoured or refused with a message saying it is not supported
(``openai_params.py`` holds the refusals and the sampling fields' conversion,
``openai_prompt.py`` the messages' and the prompt's).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from services.common.errors import InvalidRequestError


class Body(BaseModel):
    """A request body (or part of one): unknown fields are a 400, never ignored."""

    model_config = ConfigDict(extra="forbid")


class ImageUrl(Body):
    url: StrictStr
    detail: StrictStr | None = None  # auto or high; low (a downscaled image) is refused


class ContentPartBody(Body):
    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageUrl | StrictStr | None = None


class FunctionBody(Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # the arguments follow ``parameters`` exactly


class ToolBody(Body):
    type: StrictStr  # function
    function: FunctionBody


class NamedFunction(Body):
    name: StrictStr


class NamedToolChoice(Body):
    type: StrictStr  # function
    function: NamedFunction


class ToolCallFunction(Body):
    name: StrictStr
    arguments: StrictStr  # a JSON object's text


class ToolCallBody(Body):
    id: StrictStr
    type: StrictStr  # function
    function: ToolCallFunction


class ChatMessageBody(Body):
    role: StrictStr
    content: StrictStr | list[ContentPartBody] | None = None
    name: StrictStr | None = None  # refused: the chat template has no participant names
    tool_calls: list[ToolCallBody] | None = None  # assistant messages only
    tool_call_id: StrictStr | None = None  # tool messages: the call this is the result of


class StreamOptions(Body):
    include_usage: StrictBool = False


# A JSON schema: an object, a boolean, or its JSON text (vLLM takes the text too).
JsonSchema = dict[str, Any] | StrictBool | StrictStr


class StructuredOutputsBody(Body):
    """vLLM's ``structured_outputs``: exactly one constraint on the output."""

    # "json" as sent (pydantic's BaseModel has a json attribute the field must not shadow)
    json_schema: JsonSchema | None = Field(None, alias="json")  # validates against the schema
    regex: StrictStr | None = None  # the whole output matches (xgrammar's regex dialect)
    choice: list[StrictStr] | None = None  # exactly one of these strings
    grammar: StrictStr | None = None  # an EBNF (GBNF) grammar as xgrammar reads it, from root
    # xgrammar's structural tag, as JSON text or an object
    structural_tag: StrictStr | dict[str, Any] | None = None
    json_object: StrictBool | None = None  # true: any JSON object (only true is taken)


# (field, is its value one this server honours, why another value is refused)
Refusal = tuple[str, Any, str]


def _unset(value: Any) -> bool:
    return value is None


class _GenerationBody(Body):
    """The fields chat and text completions share (OpenAI's, then vLLM-style extensions)."""

    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        (
            "service_tier",
            lambda v: v in (None, "auto", "default"),
            "only the default service tier is supported",
        ),
    )
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None  # choices: independent samples of the prompt
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    logit_bias: dict[StrictStr, StrictFloat] | None = None  # {"<token id>": bias in [-100, 100]}
    # End-user ids OpenAI keeps for abuse monitoring; they never change the output.
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None  # auto / default (the one tier)
    # Extensions (vLLM's names and meanings).
    top_k: StrictInt | None = None  # -1 or 0 = off
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = None  # EOS and stop_token_ids are masked until this many tokens
    stop_token_ids: list[StrictInt] | None = (
        None  # token ids that end generation (kept in the output)
    )
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
    response_format: dict[str, Any] | None = None
    # vLLM's structured outputs; a request sets at most one constraint, here or above
    structured_outputs: StructuredOutputsBody | None = None
    # vLLM's older names for structured_outputs' json, regex, choice and grammar
    guided_json: JsonSchema | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    # false: the model's special tokens stay in the output text (the router's detokenizer)
    skip_special_tokens: StrictBool = True
    # Either value, the same text: the byte-level BPE decoder writes nothing between tokens,
    # so kept special tokens come out back to back (vLLM's output for these tokenizers too).
    spaces_between_special_tokens: StrictBool = True


class ChatCompletionBody(_GenerationBody):
    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        *_GenerationBody.REFUSALS,
        ("functions", _unset, "functions are not supported yet (no tools)"),
        ("function_call", _unset, "function_call is not supported yet (no tools)"),
        ("audio", _unset, "audio output is not supported"),
        ("modalities", lambda v: v in (None, ["text"]), 'only text output (["text"]) is supported'),
        ("prediction", _unset, "predicted outputs are not supported"),
        (
            "reasoning_effort",
            _unset,
            "reasoning_effort is not supported (the model does not reason)",
        ),
        ("verbosity", _unset, "verbosity is not supported"),
        ("web_search_options", _unset, "web search is not supported"),
        ("store", lambda v: not v, "stored completions are not supported"),
        ("metadata", _unset, "metadata is kept with stored completions, which are not supported"),
        ("prompt_cache_key", _unset, "prompt_cache_key is not supported"),
    )
    messages: list[ChatMessageBody]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None  # each output token's logprob (raw model log-softmax)
    top_logprobs: StrictInt | None = None  # 0..20 most likely tokens per position; needs logprobs
    tools: list[ToolBody] | None = None
    tool_choice: StrictStr | NamedToolChoice | None = None  # none / auto / required / named
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict[str, Any] | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None
    # vLLM's chat template fields (``chat_template.py``)
    add_generation_prompt: StrictBool = True  # end the prompt with the assistant turn's header
    continue_final_message: StrictBool = False  # the model continues the last (assistant) message
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # extra template variables


class CompletionBody(_GenerationBody):
    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        *_GenerationBody.REFUSALS,
        ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported yet"),
        ("suffix", lambda v: v in (None, ""), "suffix is not supported yet"),
    )
    # a text, token ids, or a batch of either (each prompt its n choices, vLLM's order)
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None = None
    # vLLM's format: base64 of torch.save of a [num_tokens, hidden] float32/bfloat16/float16 tensor
    prompt_embeds: StrictStr | None = None
    echo: StrictBool = False  # the prompt text comes first (with logprobs: its tokens' too)
    # 0..20 (OpenAI: 0..5; vLLM allows 20): the sampled tokens' logprobs and this many top ones
    logprobs: StrictInt | None = None
    # vLLM's extension, 0..20: each prompt token's logprob and this many top ones (not streamed)
    prompt_logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error body (documented in /openapi.json; the handlers write it with ``error_body``)."""

    error: ErrorDetail


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this router does not serve (HTTP 400, code model_not_found)."""

    code = "model_not_found"


def check_model(model: str | None, served_model_name: str) -> None:
    if model not in (None, "", served_model_name):
        raise ModelNotFoundError(
            f"the model {model!r} does not exist; this server serves {served_model_name!r}",
            param="model",
        )


def check_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON ``"\\ud800"``) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: it holds a lone surrogate at index {exc.start}",
            param=param,
        ) from None
    return text
