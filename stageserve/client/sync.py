"""The blocking client of ``stageserve.v1.Router``."""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType
from typing import Any, Unpack

import grpc

from services.common.pb.stageserve.v1 import router_pb2_grpc
from stageserve.client.calls import CHANNEL_OPTIONS, BaseClient, CallOptions, check_one_choice
from stageserve.client.errors import error_from_rpc
from stageserve.client.types import Chunk, Completion, CompletionBuilder, chunk_from_proto


class Stream:
    """One call's chunks as they arrive: iterate it, or ``completion()`` joins them. A failure
    raises its ``StageServeError`` class. ``cancel()`` (or leaving a ``with`` block) ends the
    call on the router; iterating it then raises ``AbortedError``."""

    def __init__(self, call: Any, request_id: str) -> None:
        self.request_id = request_id
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        try:
            response = next(self._call)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.request_id) from exc
        return chunk_from_proto(response)

    def completion(self) -> Completion:
        """Every remaining chunk, joined (a call of one choice)."""
        return self._builder().completion()

    def completions(self) -> tuple[Completion, ...]:
        """Every remaining chunk, joined per choice, by choice index."""
        return self._builder().completions()

    def _builder(self) -> CompletionBuilder:
        builder = CompletionBuilder()
        for chunk in self:
            builder.add(chunk)
        return builder

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cancel()


class Client(BaseClient):
    """A blocking client of the router's gRPC API at ``address`` (``host:port``: ``stageserve up
    --grpc-port``). ``api_key``: sent on every call (the router's ``--api-key``).
    ``timeout_s``: each call's deadline unless the call gives its own (None: no deadline of the
    client's; the router's ``--request-timeout-s`` still applies). Threads may share it."""

    def __init__(
        self, address: str, *, api_key: str | None = None, timeout_s: float | None = 300.0
    ) -> None:
        super().__init__(api_key, timeout_s)
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def stream(self, prompt: str | None = None, **options: Unpack[CallOptions]) -> Stream:
        """Start generating from a raw ``prompt`` (no chat template) or from ``messages`` (the
        model's chat template); the chunks stream as they are generated. ``sampling``: how
        tokens are drawn (None: the server's defaults). ``stop``: strings that end the text
        (not included). ``model``: empty for the served one. ``request_id``: the id the
        router's logs and every chunk carry (default: a fresh one). ``timeout_s``: this call's
        deadline (None: the client's). ``num_choices``: independent samples, each chunk naming
        its ``choice_index``. ``tools`` (with ``messages``), ``tool_choice`` (``none``,
        ``auto``, ``required`` or a ``ToolChoice``) and ``parallel_tool_calls``: as the HTTP
        API's; chunks then carry ``tool_calls`` and ``text`` only the rest.
        ``add_generation_prompt`` (None: true), ``continue_final_message`` and
        ``chat_template_kwargs`` (a JSON object: extra chat template variables), with
        ``messages``, and ``skip_special_tokens`` (None: true): as the HTTP API's (vLLM's)."""
        spec = self._call_spec(prompt, options)
        call = self._stub.Generate(spec.request, timeout=spec.timeout_s, metadata=spec.metadata)
        return Stream(call, spec.request_id)

    def generate(self, prompt: str | None = None, **options: Unpack[CallOptions]) -> Completion:
        """``stream`` with the same arguments (one choice: ``generate_choices`` for more),
        joined into one ``Completion``."""
        check_one_choice(options)
        with self.stream(prompt, **options) as stream:
            return stream.completion()

    def generate_choices(
        self, prompt: str | None = None, **options: Unpack[CallOptions]
    ) -> tuple[Completion, ...]:
        """``stream`` with the same arguments, joined into each choice's ``Completion``."""
        with self.stream(prompt, **options) as stream:
            return stream.completions()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
