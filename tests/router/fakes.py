"""Fake tokenizer and prefill workers (decode's: ``fake_decode.py``): real gRPC servers
(port 0) with canned behaviour, and ``start_worker``, which serves any of them.

The output of every request comes from one ``Script``: the token ids the model
"generates" (the first from prefill, the rest streamed by decode), how decode chunks
and paces them, and how it fails. Prefill answers the logprobs a request asks for
(``fake_logprob``: the first token's, the prompt's); decode answers none. The tokenizer fake
encodes prompt text with the tiny checkpoint's tokenizer and gives each image a fixed number
of placeholder tokens.

Each fake also has per-worker knobs (set on its servicer) for fault tests: ``hang`` makes
a call answer nothing until the caller cancels it (a frozen worker: its gRPC port still
accepts calls; decode's Abort still answers), ``cancelled`` lists the request ids whose
call the caller cancelled, decode's ``capacity`` refuses Reserve (RESOURCE_EXHAUSTED)
while that many requests hold pages, and prefill's ``capacity`` refuses Prefill while that
many are in flight.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common import signing
from services.common.auth import Credentials
from services.common.errors import (
    CapacityError,
    InvalidRequestError,
)
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import (
    common_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.server import HealthState, create_server
from services.common.types import TokenLogprob
from services.common.wire import sampling_params_from_proto, token_logprob_to_proto
from services.engine.processing import TextProcessor
from tests.conftest import TINY_MODEL_DIR

TEXT = TextProcessor.from_dir(TINY_MODEL_DIR)
EOS_ID = TEXT.eos_token_ids[-1]
NUM_IMAGE_TOKENS = 4


def char_ids(text: str) -> list[int]:
    """One token per character (every ASCII character is a token of the tiny vocabulary)."""
    ids = [TEXT.encode(c) for c in text]
    assert all(len(i) == 1 for i in ids), f"{text!r} has a character of several tokens"
    return [i[0] for i in ids]


@dataclass
class Script:
    """What the fake model generates and how the fake workers behave."""

    output_ids: list[int] = field(
        default_factory=lambda: [*char_ids("Hello there, world!"), EOS_ID]
    )
    chunk_size: int = 2  # tokens per decode message
    chunk_delay_s: float = 0.0  # pause before each decode message
    prefill_delay_s: float = 0.0
    decode_fail_after: int | None = None  # stop the decode server after this many messages
    reserve_error: Exception | None = None
    prefill_error: Exception | None = None
    tokenize_error: Exception | None = None


def fake_logprob(token_id: int, position: int, num_top: int) -> TokenLogprob:
    """The fake model's logprob of ``token_id`` at ``position`` (exact in float32) and its
    ``num_top`` top ones: the token, then the ids after it, each 0.25 less likely."""
    logprob = -(position + 1) / 8
    return TokenLogprob(
        token_id,
        logprob,
        tuple(token_id + k for k in range(num_top)),
        tuple(logprob - k / 4 for k in range(num_top)),
    )


HANG_S = 3600.0  # "forever": a hanging call ends when its caller cancels it


async def hang_until_cancelled(cancelled: list[str], request_id: str) -> None:
    try:
        await asyncio.sleep(HANG_S)
    except asyncio.CancelledError:
        cancelled.append(request_id)
        raise


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    REGISTRAR = (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, "stageserve.v1.Tokenizer")

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tokenizer_pb2.TokenizeRequest] = []
        self.hang = False
        self.cancelled: list[str] = []

    @handle_errors
    async def Tokenize(self, request: Any, context: Any) -> tokenizer_pb2.TokenizeResponse:
        self.requests.append(request)
        if self.hang:
            await hang_until_cancelled(self.cancelled, request.request_id)
        if self.script.tokenize_error is not None:
            raise self.script.tokenize_error
        if request.WhichOneof("input") == "prompt":
            return tokenizer_pb2.TokenizeResponse(token_ids=TEXT.encode(request.prompt))
        ids: list[int] = []
        response = tokenizer_pb2.TokenizeResponse()
        for message in request.chat.messages:
            if message.role not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"unknown role {message.role}", param="messages")
            ids.extend(TEXT.encode(f"<{message.role}>"))
            for part in message.content:
                if part.WhichOneof("part") == "text":
                    ids.extend(TEXT.encode(part.text))
                    continue
                digest = f"hash{len(response.image_spans)}"
                response.image_spans.add(
                    offset=len(ids),
                    length=NUM_IMAGE_TOKENS,
                    content_hash=digest,
                    grid_t=1,
                    grid_h=4,
                    grid_w=4,
                )
                ids.extend([TEXT.image_token_id] * NUM_IMAGE_TOKENS)
        response.token_ids.extend(ids)
        return response


FAKE_KEY = b"fake-internal-token"  # the key the fake decode and prefill share


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    REGISTRAR = (prefill_pb2_grpc.add_PrefillServicer_to_server, "stageserve.v1.Prefill")

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.hang = False
        self.first_delay_s = 0.0  # the first Prefill answers this much later (queued behind others)
        self.error: Exception | None = None  # this worker's failure (over the script's)
        self.cancelled: list[str] = []
        self.capacity: int | None = None  # requests its queue holds at once (None: any)
        self.num_in_flight = 0
        self.num_refused = 0
        self.prefix_cached = (0, 0)  # (tokens, image tokens among them) its answers report

    @handle_errors
    async def Prefill(self, request: Any, context: Any) -> prefill_pb2.PrefillResponse:
        if self.capacity is not None and self.num_in_flight >= self.capacity:
            self.num_refused += 1
            raise CapacityError(f"prefill queue is full ({self.capacity} requests)")
        self.num_in_flight += 1
        try:
            return await self._prefill(request)
        finally:
            self.num_in_flight -= 1

    async def _prefill(self, request: Any) -> prefill_pb2.PrefillResponse:
        self.requests.append(request)
        if self.hang:
            await hang_until_cancelled(self.cancelled, request.request_id)
        await asyncio.sleep(
            self.script.prefill_delay_s + (self.first_delay_s if len(self.requests) == 1 else 0.0)
        )
        if self.error is not None:
            raise self.error
        if self.script.prefill_error is not None:
            raise self.script.prefill_error
        first = self.script.output_ids[0]
        proof = signing.kv_written_proof(FAKE_KEY, request.kv_ref.request_id, request.kv_ref.nonce)
        response = prefill_pb2.PrefillResponse(
            first_token_id=first,
            kv_written_proof=proof,
            num_prefix_cached_tokens=self.prefix_cached[0],
            num_prefix_cached_image_tokens=self.prefix_cached[1],
        )
        self._add_logprobs(request, response)
        if first == EOS_ID:
            response.finish_reason = common_pb2.FINISH_REASON_STOP
        elif request.sampling_params.max_new_tokens == 1:
            response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        return response

    @staticmethod
    def _add_logprobs(request: Any, response: prefill_pb2.PrefillResponse) -> None:
        params = sampling_params_from_proto(request.sampling_params)
        ids = list(request.token_ids)
        if params.return_logprobs:
            first = fake_logprob(response.first_token_id, len(ids), params.num_top_logprobs)
            response.first_logprob.CopyFrom(token_logprob_to_proto(first))
        if params.num_prompt_logprobs >= 0:
            response.prompt_logprobs.extend(
                token_logprob_to_proto(fake_logprob(t, i, params.num_prompt_logprobs))
                for i, t in enumerate(ids[1:], start=1)
            )


@dataclass
class FakeWorker:
    servicer: Any
    server: grpc.aio.Server
    health: HealthState
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


async def start_worker(servicer: Any, auth: Credentials | None = None) -> FakeWorker:
    """A served fake (its class's ``REGISTRAR``: the add function and service name);
    ``auth``: the internal token it requires (None: none)."""
    add, name = type(servicer).REGISTRAR
    health = HealthState()
    server, port = create_server(
        [(add, servicer)], 0, health=health, service_names=[name], auth=auth
    )
    await server.start()
    health.set_serving(True)
    if hasattr(servicer, "server"):  # decode's fake stops its own server (decode_fail_after)
        servicer.server = server
    return FakeWorker(servicer, server, health, port)
