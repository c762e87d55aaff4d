"""The fake decode worker: Reserve, the token Stream, Abort and Stats over real gRPC, the
tokens from the ``Script`` (``fakes.py``), with knobs for fault tests (``hang_reserve``,
``hang_after``, ``capacity``, ``waiting_s``, ``release``, ``reserve_errors``).

``python -m tests.router.fake_decode [LETTER]`` runs one alone (for kill tests) and prints its
port; it generates LETTER (default x) over and over, and SIGUSR1 / SIGUSR2 turn its health
NOT_SERVING / SERVING.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from typing import Any

import grpc

from services.common import signing
from services.common.errors import (
    AbortedError,
    CapacityError,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
)
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.wire import stream_error_to_proto
from services.decode.streams import WAITING_LIST_S
from tests.router.fakes import (
    EOS_ID,
    FAKE_KEY,
    HANG_S,
    Script,
    char_ids,
    hang_until_cancelled,
    start_worker,
)


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
    REGISTRAR = (decode_pb2_grpc.add_DecodeServicer_to_server, "stageserve.v1.Decode")

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


async def _serve_decode_forever(letter: str) -> None:
    script = Script(output_ids=[*char_ids(letter * 500), EOS_ID], chunk_size=1, chunk_delay_s=0.02)
    worker = await start_worker(FakeDecode(script))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, worker.health.set_serving, False)
    loop.add_signal_handler(signal.SIGUSR2, worker.health.set_serving, True)
    print(f"READY decode port={worker.port}", flush=True)
    await worker.server.wait_for_termination()


if __name__ == "__main__":
    assert len(sys.argv) <= 2, "usage: python -m tests.router.fake_decode [LETTER]"
    asyncio.run(_serve_decode_forever(sys.argv[1] if len(sys.argv) == 2 else "x"))
