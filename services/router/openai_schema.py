"""OpenAI request bodies (pydantic, parsed by FastAPI) and their checks into router types.

Shape errors (missing or mistyped fields) are FastAPI's validation errors; range and
consistency errors are ``InvalidRequestError`` raised here with the offending ``param``.
Types are strict: a boolean is ``true``/``false``, an integer is an integer (not ``1.0``,
``"1"`` or ``true``); a number field takes integers too. Sampling ranges are
``SamplingParams.validate``'s, the same for HTTP and gRPC. Unknown fields are accepted
and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from services.common.errors import InvalidRequestError
from services.common.types import ChatMessage, ContentPart, ImagePart, TextPart
from services.engine.sampler import SamplingParams
from services.router import prompt_embeds
from services.router.images import ImageLoader
from services.router.prompt_embeds import PromptEmbeds

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class ImageUrl(_Body):
    url: StrictStr
    detail: StrictStr | None = None


class ContentPartBody(_Body):
    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageUrl | StrictStr | None = None


class ChatMessageBody(_Body):
    role: StrictStr
    content: StrictStr | list[ContentPartBody] | None = None
    name: StrictStr | None = None


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _GenerationBody(_Body):
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # extension (vLLM-style); -1 or 0 = off
    min_p: StrictFloat | None = None  # extension
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None  # extension
    ignore_eos: StrictBool = False  # extension
    logprobs: Any = None
    user: StrictStr | None = None


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessageBody]
    max_completion_tokens: StrictInt | None = None


class CompletionBody(_GenerationBody):
    prompt: StrictStr | list[StrictStr] | None = None
    # vLLM's format: base64 of torch.save of a [num_tokens, hidden] float32/bfloat16/float16 tensor
    prompt_embeds: StrictStr | None = None


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


class GenerationOptions:
    """What a body asks for, checked: sampling parameters, token budget and stop strings."""

    def __init__(self, params: SamplingParams, max_tokens: int | None, stop: tuple[str, ...]) -> None:
        self.params = params
        self.max_tokens = max_tokens
        self.stop = stop


def check_model(model: str | None, served_model_name: str) -> None:
    if model not in (None, "", served_model_name):
        raise ModelNotFoundError(
            f"the model {model!r} does not exist; this server serves {served_model_name!r}", param="model"
        )


def check_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON ``"\\ud800"``) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: it holds a lone surrogate at index {exc.start}", param=param
        ) from None
    return text


def _max_tokens(body: _GenerationBody) -> int | None:
    param, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        param, value = "max_completion_tokens", body.max_completion_tokens
    if value is not None and value <= 0:
        raise InvalidRequestError(f"{param} must be > 0, got {value}", param=param)
    return value


def _stop_strings(stop: str | list[str] | None, max_stop_strings: int) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > max_stop_strings:
        raise InvalidRequestError(f"stop takes at most {max_stop_strings} strings, got {len(strings)}", param="stop")
    if any(not s for s in strings):
        raise InvalidRequestError("stop strings must not be empty", param="stop")
    params = ["stop"] if isinstance(stop, str) else [f"stop[{i}]" for i in range(len(strings))]
    return tuple(dict.fromkeys(check_text(s, param) for s, param in zip(strings, params, strict=True)))


def generation_options(body: _GenerationBody, max_stop_strings: int) -> GenerationOptions:
    """Check the sampling fields every endpoint shares; ``InvalidRequestError`` on the first bad one."""
    if body.n not in (None, 1):
        raise InvalidRequestError(f"only n=1 is supported, got n={body.n}", param="n")
    if body.logprobs not in (None, False, 0):
        raise InvalidRequestError("logprobs are not supported", param="logprobs")
    fields: dict[str, Any] = {
        "temperature": body.temperature, "top_p": body.top_p, "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "top_k": 0 if body.top_k == -1 else body.top_k,  # -1 = off, as in vLLM
        "seed": None if body.seed is None else body.seed % 2**64,  # OpenAI seeds may be negative
    }
    params = SamplingParams(**{k: v for k, v in fields.items() if v is not None}, ignore_eos=body.ignore_eos)
    params.validate()
    return GenerationOptions(params, _max_tokens(body), _stop_strings(body.stop, max_stop_strings))


def completion_input(body: CompletionBody) -> str | PromptEmbeds:
    """The completion's one input: its prompt text, or its ``prompt_embeds`` unpacked."""
    if (body.prompt is None) == (body.prompt_embeds is None):
        raise InvalidRequestError("give exactly one of prompt and prompt_embeds", param="prompt")
    if body.prompt_embeds is not None:
        return prompt_embeds.from_base64(body.prompt_embeds)
    return completion_prompt(body)


def completion_prompt(body: CompletionBody) -> str:
    assert body.prompt is not None
    if isinstance(body.prompt, str):
        return check_text(body.prompt, "prompt")
    if len(body.prompt) != 1:
        raise InvalidRequestError(f"prompt must be a string or a list of one string, got {len(body.prompt)}",
                                  param="prompt")
    return check_text(body.prompt[0], "prompt[0]")


async def chat_messages(messages: list[ChatMessageBody], images: ImageLoader) -> tuple[ChatMessage, ...]:
    """The conversation as router types, with every image_url loaded as compressed bytes."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        role = ROLES.get(message.role)
        if role is None:
            raise InvalidRequestError(
                f"unknown role {message.role!r}; expected one of {', '.join(ROLES)}", param=f"messages[{i}].role"
            )
        out.append(ChatMessage(role, await _content(message.content, f"messages[{i}].content", images)))
    return tuple(out)


async def _content(content: str | list[ContentPartBody] | None, param: str, images: ImageLoader) -> tuple[ContentPart, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(check_text(content, param)),)
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type == "text":
            if part.text is None:
                raise InvalidRequestError("a text part needs a text field", param=f"{where}.text")
            parts.append(TextPart(check_text(part.text, f"{where}.text")))
        elif part.type == "image_url":
            if part.image_url is None:
                raise InvalidRequestError("an image_url part needs an image_url field", param=f"{where}.image_url")
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            parts.append(ImagePart(await images.load(url, f"{where}.image_url")))
        else:
            raise InvalidRequestError(
                f"unsupported content part type {part.type!r}; expected text or image_url", param=f"{where}.type"
            )
    return tuple(parts)
