"""Chat messages and chat templates: the checks every chat passes before it is rendered,
the masking of message texts ``encode_chat`` renders with, the chat template's jinja2
environment (rendered the way ``transformers`` renders it: sandboxed, ``trim_blocks`` /
``lstrip_blocks``, ``raise_exception``, ``tojson`` and ``strftime_now``), and the checks of
a request's extra template variables (vLLM's ``chat_template_kwargs``), which the router
makes before it sends them and the tokenizer again on what it receives."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidRequestError, ModelLoadError

CHAT_ROLES = frozenset({"system", "user", "assistant"})
IMAGE_PART_TYPES = frozenset({"image", "image_url"})
CONTENT_PART_TYPES = IMAGE_PART_TYPES | {"text"}

# Stands in for the i-th message text while the template renders: private-use code
# points, which no chat template writes.
_TEXT_SENTINEL = "\ue000{}\ue001"
TEXT_SENTINEL_RE = re.compile("\ue000([0-9]+)\ue001")

# chat_template_kwargs: at most this many keys, this many bytes as compact JSON (UTF-8)
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
TEMPLATE_KWARGS_PARAM = "chat_template_kwargs"
# Names a request's template variables may not take: what the render passes itself (the
# messages, add_generation_prompt, the special tokens' texts), what transformers and vLLM
# pass to templates and this server writes into the messages or handles itself (tools,
# documents, continue_final_message, ...), and the environment's globals.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "tool_choice",
        "documents",
        "chat_template",
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "raise_exception",
        "strftime_now",
        "range",
        "dict",
        "lipsum",
        "cycler",
        "joiner",
        "namespace",
        "loop",
        "self",
        "caller",
        "varargs",
        "kwargs",
    }
)
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---------------------------------------------------------------- message checks


def validate_messages(messages: Any) -> None:
    """Raise InvalidRequestError, naming the offending field, unless messages is a chat."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages", param="messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"{param} must be an object with 'role' and 'content'", param=param
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{param}.role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                param=f"{param}.role",
            )
        if "content" not in message or message["content"] is None:
            raise InvalidRequestError(f"{param}.content is missing", param=f"{param}.content")
        _validate_content(message["content"], f"{param}.content")


def _validate_content(content: Any, param: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise InvalidRequestError(
            f"{param} must be a string or a list of content parts", param=param
        )
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if not isinstance(part, Mapping):
            raise InvalidRequestError(
                f"{part_param} must be an object with a 'type'", param=part_param
            )
        part_type = part.get("type")
        if part_type not in CONTENT_PART_TYPES:
            raise InvalidRequestError(
                f"{part_param}.type must be one of {sorted(CONTENT_PART_TYPES)}, got {part_type!r}",
                param=f"{part_param}.type",
            )
        if part_type == "text" and not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{part_param}.text must be a string", param=f"{part_param}.text"
            )


def iter_image_parts(messages: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    """Image content parts in prompt order: the order of the rendered placeholders."""
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for part in content:
            if part.get("type") in IMAGE_PART_TYPES:
                yield part


def text_sentinel(index: int) -> str:
    """What stands in for the ``index``-th text of ``mask_message_texts``' messages."""
    return _TEXT_SENTINEL.format(index)


def mask_message_texts(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[str]]:
    """Copies of (validated) messages with each content text replaced by a numbered
    sentinel, and the texts in sentinel order."""
    texts: list[str] = []

    def sentinel(text: str) -> str:
        texts.append(text)
        return text_sentinel(len(texts) - 1)

    masked = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            content = sentinel(content)
        else:
            content = [
                {**part, "text": sentinel(part["text"])} if part.get("type") == "text" else part
                for part in content
            ]
        masked.append({**message, "content": content})
    return masked, texts


# ---------------------------------------------------------------- template variables


def check_template_kwargs(kwargs: Mapping[str, Any], param: str = TEMPLATE_KWARGS_PARAM) -> str:
    """``kwargs`` (a request's extra template variables) as compact JSON text, or
    ``InvalidRequestError`` naming ``param`` (or ``<param>.<key>``): at most
    ``MAX_TEMPLATE_KWARGS`` keys, each a name a template can read (``[A-Za-z_][A-Za-z0-9_]*``)
    and none of ``RESERVED_TEMPLATE_NAMES``, values JSON (no NaN or infinity, valid Unicode),
    at most ``MAX_TEMPLATE_KWARGS_BYTES`` as JSON."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(
            f"{param} takes at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}", param=param
        )
    for key in kwargs:
        if not isinstance(key, str) or not _TEMPLATE_NAME.fullmatch(key):
            shown = str(key) if len(str(key)) <= 40 else str(key)[:40] + "..."
            raise InvalidRequestError(
                f"{param} keys are template variable names ([A-Za-z_][A-Za-z0-9_]*), got {shown!r}",
                param=param,
            )
        if key in RESERVED_TEMPLATE_NAMES:
            raise InvalidRequestError(
                f"{param}.{key} is a variable the chat template render sets itself (or a "
                "field of its own); it cannot be passed in chat_template_kwargs",
                param=f"{param}.{key}",
            )
    try:
        text = json.dumps(kwargs, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        raise InvalidRequestError(
            f"{param} values must be JSON (no NaN or infinity, not nested too deep)", param=param
        ) from None
    try:
        num_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: it holds a lone surrogate", param=param
        ) from None
    if num_bytes > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(
            f"{param} is {num_bytes} bytes as JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}",
            param=param,
        )
    return text


def template_kwargs_from_json(text: str, param: str = TEMPLATE_KWARGS_PARAM) -> dict[str, Any]:
    """The template variables of ``text`` (a JSON object's text; empty: none), checked as
    ``check_template_kwargs`` checks them; ``InvalidRequestError`` naming ``param``."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except (ValueError, RecursionError):
        kwargs = None
    if not isinstance(kwargs, dict):
        raise InvalidRequestError(f"{param} must be a JSON object's text", param=param)
    check_template_kwargs(kwargs, param)
    return kwargs


def template_variables(template: jinja2.Template, source: str) -> frozenset[str]:
    """The variables ``template`` (compiled from ``source``) reads from its render's
    arguments: every name it uses without setting it, macros included, the environment's
    globals left out."""
    return frozenset(meta.find_undeclared_variables(template.environment.parse(source)))


# ---------------------------------------------------------------- chat template


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def find_chat_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str:
    jinja_path = model_dir / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template") or read_json(
        model_dir / "chat_template.json"
    ).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise ModelLoadError(
            f"{model_dir} has no chat template (chat_template.jinja or tokenizer_config.json)"
        )
    return template
