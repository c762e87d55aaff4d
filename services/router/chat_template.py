"""vLLM's chat template fields of a request: ``add_generation_prompt``,
``continue_final_message`` and ``chat_template_kwargs``, checked once for the HTTP API (chat
completions and ``/tokenize``) and gRPC ``Router.Generate`` before any worker is called.

The tokenizer renders with them (``TextProcessor.render_chat``) and checks them again; what
only the template tells (whether it reads a variable) is checked there, and its 400 names
``chat_template_kwargs.<key>`` too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import ChatMessage, TextPart
from services.engine.processing.chat import check_template_kwargs
from services.router.types import ChatTemplateOptions

CONTINUE_PARAM = "continue_final_message"


def template_options(
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: Mapping[str, Any] | None,
    kwargs_param: str = "chat_template_kwargs",
) -> ChatTemplateOptions:
    """The options checked: not both ``add_generation_prompt`` and ``continue_final_message``
    (as vLLM); ``kwargs`` within ``check_template_kwargs``' limits, none of its keys one the
    render sets itself. ``InvalidRequestError`` naming the field (or ``<kwargs_param>.<key>``)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message continues the last message, add_generation_prompt starts a "
            "new one: both cannot be true (set add_generation_prompt to false)",
            param=CONTINUE_PARAM,
        )
    text = check_template_kwargs(kwargs, kwargs_param) if kwargs else ""
    return ChatTemplateOptions(add_generation_prompt, continue_final_message, text)


def check_final_message(template: ChatTemplateOptions, messages: Sequence[ChatMessage]) -> None:
    """With ``continue_final_message``: the chat (tool turns written in) ends with an assistant
    message that ends with text, which the model continues."""
    if not template.continue_final_message or not messages:
        return
    final = messages[-1]
    if final.role != "assistant":
        raise InvalidRequestError(
            "continue_final_message continues the last message, which must be an assistant "
            f"message; it is a {final.role} message",
            param=CONTINUE_PARAM,
        )
    if not final.content or not isinstance(final.content[-1], TextPart):
        raise InvalidRequestError(
            "continue_final_message needs the last message to end with text",
            param=CONTINUE_PARAM,
        )
