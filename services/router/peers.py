"""What the router needs from each kind of worker: the typed clients' methods it calls.

The real clients (``services.common.clients.*``) satisfy these structurally; tests may
pass fakes. Every method raises the ``StageServeError`` subclass its worker answered with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from services.common.types import ChatMessage, ImageHeader, SamplingParams, TokenizedPrompt


class TokenizerPeer(Protocol):
    async def tokenize_chat(
        self,
        request_id: str,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        timeout_s: float = ...,
        headers: Sequence[ImageHeader | None] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: str = "",
    ) -> TokenizedPrompt: ...

    async def tokenize_prompt(
        self, request_id: str, prompt: str, timeout_s: float = ...
    ) -> TokenizedPrompt: ...

    async def close(self) -> None: ...


class PrefillPeer(Protocol):
    async def prefill(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        kv_ref: Any,
        deadline_unix_s: float,
    ) -> Any: ...  # PrefillResult: first_token_id, finish_reason, kv_written_proof, ...

    async def close(self) -> None: ...


class DecodePeer(Protocol):
    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        mrope_position_delta: int,
        params: SamplingParams,
        deadline_unix_s: float,
    ) -> Any: ...  # KvRefInfo: where prefill writes the prompt's KV

    def generate(
        self, request_id: str, first_token_id: int, timeout_s: float, *, kv_written_proof: bytes
    ) -> AsyncIterator[Any]: ...  # DecodeChunk: token_ids, finish_reason and usage on the last one

    async def abort(
        self, request_id: str, reason: str = "", *, is_kv_written: bool = False
    ) -> Any: ...

    async def close(self) -> None: ...
