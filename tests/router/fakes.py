"""Fake tokenizer, prefill and decode workers: real gRPC servers (port 0) with canned behaviour.

The output of every request comes from one ``Script``: the token ids the model
"generates" (the first from prefill, the rest streamed by decode), how decode chunks
and paces them, and how it fails. The tokenizer fake encodes prompt text with the tiny
checkpoint's tokenizer and gives each image a fixed number of placeholder tokens.

Each fake also has per-worker knobs (set on its servicer) for fault tests: ``hang`` makes
a call answer nothing until the caller cancels it (a frozen worker: its gRPC port still
accepts calls; decode's Abort still answers), ``cancelled`` lists the request ids whose
call the caller cancelled, and decode's ``capacity`` refuses Reserve (RESOURCE_EXHAUSTED)
while that many requests hold pages.

``python -m tests.router.fakes decode`` runs a decode fake alone (for kill tests).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common import signing
from services.common.auth import Credentials
from services.common.errors import (
    AbortedError,
    CapacityError,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
)
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from services.common.server import HealthState, create_server
from services.common.wire import stream_error_to_proto
from services.decode.streams import WAITING_LIST_S
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


HANG_S = 3600.0  # "forever": a hanging call ends when its caller cancels it


async def hang_until_cancelled(cancelled: list[str], request_id: str) -> None:
    try:
        await asyncio.sleep(HANG_S)
    except asyncio.CancelledError:
        cancelled.append(request_id)
        raise


class FakeTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
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


def _kv_ref(request_id: str, num_pages: int) -> common_pb2.KvRef:
    buffers = [
        common_pb2.KvBuffer(
            kind=kind,
            base_address=4096 * kind,
            size_bytes=1024,
            layer_stride_bytes=512,
            page_stride_bytes=64,
            slot_stride_bytes=4,
        )
        for kind in (common_pb2.KV_BUFFER_KIND_K, common_pb2.KV_BUFFER_KIND_V)
    ]
    return common_pb2.KvRef(
        request_id=request_id,
        backend="inprocess",
        session_id="fake",
        page_ids=list(range(num_pages)),
        page_size=16,
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        buffers=buffers,
        nonce=signing.new_nonce(),
    )


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script) -> None:
        self.script = script
        self.reserved: dict[str, decode_pb2.ReserveRequest] = {}
        self.aborted: list[str] = []
        self.is_kv_written: dict[str, bool] = {}  # AbortRequest.is_kv_written, by request id
        self.proofs: dict[
            str, bytes
        ] = {}  # the kv_written_proof Generate must carry, by request id
        self.generate_started = asyncio.Event()
        self.server: grpc.aio.Server | None = (
            None  # set by start_worker, stopped by decode_fail_after
        )
        self.stopping: asyncio.Task | None = None
        self.reserve_errors: list[Exception] = []  # raised by the next Reserve calls, one each
        self.hang_reserve = False
        self.hang_after: int | None = None  # Generate sends this many messages, then nothing
        self.capacity: int | None = None  # requests that may hold pages at once
        self.holding: set[str] = set()  # requests holding pages (reserved, not ended or aborted)
        self.num_refused = 0
        self.release = asyncio.Event()  # Generate waits for it before its first message
        self.waiting_s = 0.0  # Generate lists its request as waiting this long before tokens
        self.release.set()
        self.cancelled: list[str] = []  # Reserve calls the caller cancelled, and generates it left
        self.ended: set[str] = set()  # aborted and not reserved again

    def max_new_tokens(self, request_id: str) -> int:
        return self.reserved[request_id].sampling_params.max_new_tokens

    @handle_errors
    async def Reserve(self, request: Any, context: Any) -> decode_pb2.ReserveResponse:
        if self.reserve_errors:
            raise self.reserve_errors.pop(0)
        if self.hang_reserve:
            await hang_until_cancelled(self.cancelled, request.request_id)
        if self.script.reserve_error is not None:
            raise self.script.reserve_error
        if self.capacity is not None and len(self.holding) >= self.capacity:
            self.num_refused += 1
            raise CapacityError(
                f"no pages for {request.request_id}: {len(self.holding)} requests hold them"
            )
        self.holding.add(request.request_id)
        self.ended.discard(request.request_id)  # decode forgets an aborted id: it may reserve again
        self.reserved[request.request_id] = request
        kv_ref = _kv_ref(request.request_id, 1 + len(request.prompt_token_ids) // 16)
        self.proofs[request.request_id] = signing.kv_written_proof(
            FAKE_KEY, request.request_id, kv_ref.nonce
        )
        return decode_pb2.ReserveResponse(kv_ref=kv_ref)

    @handle_errors
    async def Stream(self, requests: Any, context: Any):
        """Each generate message runs on its own task; every message carries one request's chunk."""
        outbox: asyncio.Queue[decode_pb2.DecodeStreamResponse] = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def read() -> None:
            async for message in requests:
                if message.WhichOneof("kind") == "generate":
                    start = message.generate
                    tasks[start.request_id] = asyncio.create_task(
                        self._serve_generate(start, outbox)
                    )
                elif (task := tasks.pop(message.abort.request_id, None)) is not None:
                    task.cancel()  # the caller left this request

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await outbox.get()
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def _serve_generate(self, request: Any, outbox: asyncio.Queue) -> None:
        request_id = request.request_id
        try:
            reserve = self.reserved.get(request_id)
            if reserve is None:
                raise NotFoundError(f"no reservation for {request_id}")
            if request.kv_written_proof != self.proofs[request_id]:
                raise InvalidRequestError(
                    "kv_written_proof is not prefill's", param="kv_written_proof"
                )
            self.generate_started.set()
            await self.release.wait()
            waited_until = time.monotonic() + self.waiting_s
            while time.monotonic() < waited_until:  # what decode says while its batch is full
                outbox.put_nowait(decode_pb2.DecodeStreamResponse(waiting_request_ids=[request_id]))
                await asyncio.sleep(WAITING_LIST_S)
            async for message in self._generate(request, reserve):
                outbox.put_nowait(message)
        except StageServeError as exc:
            end = decode_pb2.RequestEnd(request_id=request_id, error=stream_error_to_proto(exc))
            outbox.put_nowait(decode_pb2.DecodeStreamResponse(ends=[end]))
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        finally:
            self.holding.discard(request_id)

    async def _generate(self, request: Any, reserve: Any):
        limit = reserve.sampling_params.max_new_tokens
        ids = self.script.output_ids[1:limit]
        num_messages = 0
        for start in range(0, max(len(ids), 1), self.script.chunk_size):
            await asyncio.sleep(self.script.chunk_delay_s)
            if request.request_id in self.ended:
                raise AbortedError(f"{request.request_id} was aborted")
            if self.hang_after is not None and num_messages >= self.hang_after:
                await asyncio.sleep(HANG_S)
            if (
                self.script.decode_fail_after is not None
                and num_messages >= self.script.decode_fail_after
            ):
                assert self.server is not None
                self.stopping = asyncio.create_task(
                    self.server.stop(None)
                )  # cancels the stream too
                await asyncio.sleep(3600)
            chunk = ids[start : start + self.script.chunk_size]
            is_last = start + self.script.chunk_size >= len(ids)
            message = decode_pb2.DecodeStreamResponse(
                request_ids=[request.request_id] * len(chunk), token_ids=chunk
            )
            if is_last:
                num = 1 + len(ids)
                end = message.ends.add(request_id=request.request_id)
                end.finish_reason = (
                    common_pb2.FINISH_REASON_LENGTH
                    if num >= limit
                    else common_pb2.FINISH_REASON_STOP
                )
                end.usage.CopyFrom(
                    common_pb2.Usage(
                        num_prompt_tokens=len(reserve.prompt_token_ids), num_completion_tokens=num
                    )
                )
            num_messages += 1
            yield message

    @handle_errors
    async def Abort(self, request: Any, context: Any) -> decode_pb2.AbortResponse:
        self.aborted.append(request.request_id)
        self.is_kv_written[request.request_id] = request.is_kv_written
        self.holding.discard(request.request_id)
        self.ended.add(request.request_id)
        return decode_pb2.AbortResponse(is_found=request.request_id in self.reserved)

    @handle_errors
    async def Stats(self, request: Any, context: Any) -> decode_pb2.StatsResponse:
        return decode_pb2.StatsResponse(page_size=16, num_total_pages=64, num_free_pages=64)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
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
            kv_state=common_pb2.KV_TRANSFER_STATE_SUCCESS,
            kv_written_proof=proof,
        )
        if first == EOS_ID:
            response.finish_reason = common_pb2.FINISH_REASON_STOP
        elif request.sampling_params.max_new_tokens == 1:
            response.finish_reason = common_pb2.FINISH_REASON_LENGTH
        return response


@dataclass
class FakeWorker:
    servicer: Any
    server: grpc.aio.Server
    health: HealthState
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


_REGISTRARS = {
    FakeTokenizer: (tokenizer_pb2_grpc.add_TokenizerServicer_to_server, "stageserve.v1.Tokenizer"),
    FakePrefill: (prefill_pb2_grpc.add_PrefillServicer_to_server, "stageserve.v1.Prefill"),
    FakeDecode: (decode_pb2_grpc.add_DecodeServicer_to_server, "stageserve.v1.Decode"),
}


async def start_worker(servicer: Any, auth: Credentials | None = None) -> FakeWorker:
    """A served fake; ``auth``: the internal token it requires (None: none)."""
    add, name = _REGISTRARS[type(servicer)]
    health = HealthState()
    server, port = create_server(
        [(add, servicer)], 0, health=health, service_names=[name], auth=auth
    )
    await server.start()
    health.set_serving(True)
    if isinstance(servicer, FakeDecode):
        servicer.server = server
    return FakeWorker(servicer, server, health, port)


async def _serve_decode_forever() -> None:
    script = Script(output_ids=[*char_ids("x" * 500), EOS_ID], chunk_size=1, chunk_delay_s=0.02)
    worker = await start_worker(FakeDecode(script))
    print(f"READY decode port={worker.port}", flush=True)
    await worker.server.wait_for_termination()


if __name__ == "__main__":
    assert sys.argv[1:] == ["decode"], "usage: python -m tests.router.fakes decode"
    asyncio.run(_serve_decode_forever())
