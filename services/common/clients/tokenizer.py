"""Typed client of the tokenizer service (``stageserve.v1.Tokenizer``).

``tokenize_chat`` / ``tokenize_prompt`` return a ``TokenizedPrompt``.

Every call carries a deadline, the request id (``x-request-id``) and the trace
context; gRPC failures become ``StageServeError`` subclasses (``error_from_rpc``).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common import offload, telemetry
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.grpc_errors import error_from_rpc
from services.common.image_header import content_hash, header_size
from services.common.pb.stageserve.v1 import common_pb2, tokenizer_pb2
from services.common.server import REQUEST_ID_KEY
from services.common.types import (
    ChatMessage,
    ImageHeader,
    ImagePart,
    ImageSpanRef,
    TextPart,
    TokenizedPrompt,
)

DEFAULT_TIMEOUT_S = 30.0
TOKENIZE_METHOD = f"/{tokenizer_pb2.DESCRIPTOR.services_by_name['Tokenizer'].full_name}/Tokenize"


def _metadata(request_id: str) -> list[tuple[str, str]]:
    return telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])


def read_image_headers(messages: Sequence[ChatMessage]) -> list[ImageHeader | None]:
    """Each image part's hash and size, in prompt order, read from its header alone; None for
    an image whose header does not tell its size (or that is not an image)."""
    headers: list[ImageHeader | None] = []
    for message in messages:
        for part in message.content:
            if isinstance(part, ImagePart):
                size = _header_size(part.data)
                headers.append(
                    None if size is None else ImageHeader(content_hash(part.data), *size)
                )
    return headers


async def image_headers(messages: Sequence[ChatMessage]) -> list[ImageHeader | None]:
    """``read_image_headers``, on a thread when the images are large enough to matter."""
    num_image_bytes = sum(
        len(p.data) for m in messages for p in m.content if isinstance(p, ImagePart)
    )
    return await offload.sized(num_image_bytes, read_image_headers, messages)


def chat_to_proto(
    messages: Sequence[ChatMessage], headers: Sequence[ImageHeader | None] = ()
) -> common_pb2.ChatMessages:
    """The chat as a proto. ``headers`` (``read_image_headers``'s, or none): an image with a
    header goes as its hash and size (``ImageHeaderInput``), not its bytes; any other image
    as its bytes, so the tokenizer decodes it, and a bad file gets the tokenizer's error."""
    out = common_pb2.ChatMessages()
    image_index = 0
    for message in messages:
        proto = out.messages.add(role=message.role)
        for part in message.content:
            if isinstance(part, TextPart):
                proto.content.add(text=part.text)
            elif isinstance(part, ImagePart):
                known = headers[image_index] if headers else None
                image_index += 1
                if known is None:
                    proto.content.add().image.data = part.data  # the bytes are copied once
                    continue
                header = proto.content.add().image_header
                header.content_hash = known.content_hash
                header.height, header.width = known.height, known.width
                header.num_bytes = len(part.data)
            else:
                raise TypeError(f"unknown content part {type(part).__name__}")
    assert not headers or image_index == len(headers), "one header (or None) per image part"
    return out


def _header_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from the header alone, or None (no such header, or not an image)."""
    try:
        return header_size(data, max(len(data), 1), None)  # the limits are the tokenizer's
    except InvalidRequestError:
        return None


def prompt_from_proto(
    response: tokenizer_pb2.TokenizeResponse, messages: Sequence[ChatMessage] = ()
) -> TokenizedPrompt:
    """The prompt of ``response``; its images' bytes are those of the image parts of
    ``messages`` (the chat that was tokenized): span i shows the i-th image part."""
    spans = tuple(
        ImageSpanRef(
            offset=s.offset,
            length=s.length,
            content_hash=s.content_hash,
            grid_thw=(s.grid_t, s.grid_h, s.grid_w),
        )
        for s in response.image_spans
    )
    parts = [p for m in messages for p in m.content if isinstance(p, ImagePart)]
    if len(parts) != len(spans):
        raise UnavailableError(
            f"the tokenizer answered {len(spans)} image spans for {len(parts)} image parts"
        )
    images: dict[str, bytes] = {}
    for span, part in zip(spans, parts, strict=True):
        images.setdefault(span.content_hash, part.data)
    return TokenizedPrompt(
        token_ids=tuple(response.token_ids),
        spans=spans,
        images=images,
        mrope_position_delta=response.mrope_position_delta,
    )


class TokenizerClient:
    """Calls one tokenizer service at ``address`` ("host:port")."""

    def __init__(self, address: str, *, auth: Credentials | None = None) -> None:
        """``auth``: the internal token sent on every call (None: none)."""
        self.address = address
        self._channel = create_channel(address, auth=auth)
        # Tokenize takes its request serialized already: a large chat is serialized off the loop
        self._tokenize_serialized = self._channel.unary_unary(
            TOKENIZE_METHOD,
            request_serializer=None,
            response_deserializer=tokenizer_pb2.TokenizeResponse.FromString,
        )

    async def tokenize_chat(
        self,
        request_id: str,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        headers: Sequence[ImageHeader | None] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: str = "",
    ) -> TokenizedPrompt:
        """Chat template + tokens + image spans of a conversation (images as compressed bytes;
        each whose header tells its size travels as its hash and size only). ``headers``:
        ``image_headers(messages)`` when the caller has read them already.
        ``continue_final_message`` and ``chat_template_kwargs`` (a JSON object's text, or
        empty): ``TokenizeRequest``'s.

        ``InvalidRequestError`` for a bad conversation, a non-image or oversized image, or
        a prompt at or over the context limit.
        """
        if headers is None:
            headers = await image_headers(messages)

        def serialized() -> bytes:
            return tokenizer_pb2.TokenizeRequest(
                request_id=request_id,
                chat=chat_to_proto(messages, headers),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            ).SerializeToString()

        num_bytes = sum(
            len(part.text) if isinstance(part, TextPart) else len(part.data)
            for message in messages
            for part in message.content
        )
        request = await offload.sized(num_bytes, serialized)
        return await self._tokenize(request_id, request, timeout_s, messages)

    async def tokenize_prompt(
        self, request_id: str, prompt: str, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> TokenizedPrompt:
        """Token ids of a raw prompt (no template, no images)."""
        request = await offload.sized(
            len(prompt),
            tokenizer_pb2.TokenizeRequest(request_id=request_id, prompt=prompt).SerializeToString,
        )
        return await self._tokenize(request_id, request, timeout_s)

    async def _tokenize(
        self,
        request_id: str,
        request: bytes,  # a serialized TokenizeRequest
        timeout_s: float,
        messages: Sequence[ChatMessage] = (),
    ) -> TokenizedPrompt:
        try:
            response = await self._tokenize_serialized(
                request, timeout=timeout_s, metadata=_metadata(request_id)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, service="tokenizer") from None
        return prompt_from_proto(response, messages)

    async def close(self) -> None:
        await self._channel.close()
