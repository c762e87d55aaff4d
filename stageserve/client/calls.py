"""What the blocking and the asyncio client share: the channel's options, the call options
and one call's request, metadata and deadline (``BaseClient``)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from services.common.auth import API_KEY, AUTHORIZATION_KEY, AuthConfigError, Credentials
from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import router_pb2
from stageserve.client.types import Message, Sampling, Tool, ToolChoice, build_request

# Every service logs a request under this metadata value and passes it on to the next hop
# (services.common.server.REQUEST_ID_KEY).
REQUEST_ID_KEY = "x-request-id"

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    # A stream can stay quiet for long (a request queued behind others, a long prompt): ping
    # every 30 s, the rate the router accepts, so a router that went away ends the call.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
)


def api_credentials(api_key: str | None) -> Credentials | None:
    """``api_key`` as the bearer credentials the router checks; ``InvalidRequestError`` for a
    key no header can carry (empty, spaces, non-ASCII)."""
    if api_key is None:
        return None
    try:
        return Credentials(api_key, API_KEY)
    except AuthConfigError as exc:
        raise InvalidRequestError(str(exc), param="api_key") from None


class CallOptions(TypedDict, total=False):
    """The keyword arguments of both clients' ``stream`` and ``generate``; ``call_spec`` gives
    their defaults, ``Client.stream`` their meaning."""

    messages: Sequence[Message] | None
    sampling: Sampling | None
    stop: Sequence[str]
    model: str
    request_id: str | None
    timeout_s: float | None
    num_choices: int
    tools: Sequence[Tool]
    tool_choice: str | ToolChoice | None
    parallel_tool_calls: bool | None
    add_generation_prompt: bool | None
    continue_final_message: bool
    chat_template_kwargs: Mapping[str, Any] | None
    skip_special_tokens: bool | None


@dataclass(frozen=True)
class CallSpec:
    """One ``Router.Generate`` call: its request, metadata and deadline (None: none)."""

    request: router_pb2.GenerateRequest
    metadata: tuple[tuple[str, str], ...]
    timeout_s: float | None

    @property
    def request_id(self) -> str:
        return self.request.request_id


def call_spec(
    prompt: str | None = None,
    *,
    messages: Sequence[Message] | None = None,
    sampling: Sampling | None = None,
    stop: Sequence[str] = (),
    model: str = "",
    request_id: str | None = None,
    timeout_s: float | None = None,
    credentials: Credentials | None = None,
    num_choices: int = 1,
    tools: Sequence[Tool] = (),
    tool_choice: str | ToolChoice | None = None,
    parallel_tool_calls: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    skip_special_tokens: bool | None = None,
) -> CallSpec:
    """The call for these arguments; ``request_id`` None: a fresh one (``uuid4().hex``), so
    every error and chunk names the request the router's logs show."""
    request_id = request_id if request_id is not None else uuid.uuid4().hex
    if timeout_s is not None and not timeout_s > 0:
        raise InvalidRequestError(f"timeout_s must be > 0, got {timeout_s}", param="timeout_s")
    request = build_request(
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        stop=stop,
        model=model,
        request_id=request_id,
        num_choices=num_choices,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
        skip_special_tokens=skip_special_tokens,
    )
    metadata = [(REQUEST_ID_KEY, request_id)] if request_id else []
    if credentials is not None:
        metadata.append((AUTHORIZATION_KEY, credentials.header_value))
    return CallSpec(request, tuple(metadata), timeout_s)


def check_one_choice(options: CallOptions) -> None:
    """``generate`` returns one ``Completion``: ``InvalidRequestError`` for more choices."""
    num_choices = options.get("num_choices", 1)
    if num_choices != 1:
        raise InvalidRequestError(
            f"generate returns one choice, not num_choices={num_choices}: use generate_choices",
            param="num_choices",
        )


class BaseClient:
    """The state and the call building ``Client`` and ``AsyncClient`` share; each adds its
    channel and its call style."""

    def __init__(self, api_key: str | None, timeout_s: float | None) -> None:
        self._credentials = api_credentials(api_key)
        self._timeout_s = timeout_s

    def _call_spec(self, prompt: str | None, options: CallOptions) -> CallSpec:
        """The call of ``stream(prompt, **options)``: its deadline the client's unless
        ``options`` gives one."""
        timeout_s = options.get("timeout_s")
        if timeout_s is None:
            timeout_s = self._timeout_s
        return call_spec(
            prompt, **{**options, "timeout_s": timeout_s}, credentials=self._credentials
        )
