"""``python -m services.vision_encoder --ranks 2`` as a process: LISTENING then READY, health
SERVING, rows over Mooncake from both ranks, a dead peer, SIGTERM exit 0 with no rank left; a
rank that cannot start is one clear error line; ``--ranks 2 --tp 2`` (one rank, its tower split
over two processes) sends the rows of the whole tower."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable

import grpc
import msgspec
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clients.vision_encoder import SpanStatus, VisionEncoderClient
from services.common.errors import UnavailableError
from services.transfer.embeddings import EmbeddingBuffer
from services.vision_encoder.plan import owner_rank
from tests.conftest import INTERNAL_AUTH, REPO, image_bytes, needs_mooncake
from tests.vision_encoder.conftest import Prefill, assert_rows_close, reference_rows, spans_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]
READY_TIMEOUT_S = 300
ENV = dict(os.environ, OMP_NUM_THREADS="1")  # as the references are computed (rank_threads)


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip())


def children_of(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def encoder_command(flags: str) -> list[str]:
    """The vision encoder on ports the system picks, then ``flags`` (space-separated)."""
    base = [sys.executable, "-m", "services.vision_encoder", "--port", "0", "--metrics-port", "0"]
    return [*base, *flags.split()]


def serve_then_stop(flags: str, check: Callable[[str], Awaitable[None]]) -> None:
    """The encoder with ``flags`` on two rank processes: ``check(address)`` once READY, then
    SIGTERM exits 0 with no rank left."""
    process = subprocess.Popen(
        encoder_command(flags),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        listening = lines.get(timeout=READY_TIMEOUT_S).split()  # bound, not yet serving
        assert listening[:2] == ["LISTENING", "vision_encoder"], listening
        ready = lines.get(timeout=READY_TIMEOUT_S)
        words = ready.split()
        assert words[:2] == ["READY", "vision_encoder"], ready
        fields = dict(w.split("=", 1) for w in words[2:])
        assert listening[2] == f"port={fields['port']}"  # up starts prefill on that address
        ranks = children_of(process.pid)
        assert len(ranks) == 2
        asyncio.run(check(f"127.0.0.1:{fields['port']}"))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@needs_mooncake
def test_process_serves_on_two_ranks_and_stops_on_sigterm(image_processor, vision_model) -> None:
    serve_then_stop(
        "--transfer-backend mooncake --ranks 2",
        lambda address: check_serving(address, image_processor, vision_model),
    )


async def check_serving(address: str, image_processor, vision_model) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    client = VisionEncoderClient(address, auth=INTERNAL_AUTH)
    from services.transfer.embeddings_mooncake import MooncakeEmbeddingReceiver

    receiver = MooncakeEmbeddingReceiver()  # this test process plays prefill
    buffer = EmbeddingBuffer(256, vision_model.config.vision.out_hidden_size, torch.float32)
    receiver.register(buffer)
    try:
        images = [image_bytes(70, 98, seed=s) for s in range(9, 13)]
        spans = spans_for(image_processor, images)
        assert {owner_rank(s.span.content_hash, 2) for s in spans} == {0, 1}  # both ranks send
        num_rows = sum(s.span.length for s in spans)
        results = await client.encode(
            "real", spans, receiver.destination("real", 10, num_rows), timeout_s=30
        )
        assert [r.status for r in results] == [SpanStatus.WRITTEN] * 4
        expected = torch.cat(reference_rows(vision_model, image_processor, images))
        assert_rows_close(buffer.rows(10, num_rows), expected)
        # a destination on a port where no transfer engine listens: the peer is dead
        dead = msgspec.structs.replace(
            receiver.destination("dead", 0, num_rows),
            engine_address="127.0.0.1:9",
            session_id="127.0.0.1:9",
        )
        other = spans_for(image_processor, [image_bytes(56, 56, seed=99)])
        with pytest.raises(UnavailableError):
            await client.encode("dead-peer", other, dead, timeout_s=30)
    finally:
        await client.close()
        receiver.close()


def test_process_with_tp_sends_the_rows_of_the_whole_tower(image_processor, vision_model) -> None:
    serve_then_stop(  # one encoder rank of two TP processes
        "--transfer-backend shm --ranks 2 --tp 2",
        lambda address: check_tp_rows(address, image_processor, vision_model),
    )


async def check_tp_rows(address: str, image_processor, vision_model) -> None:
    """Rows of images of several sizes, then the same again (TP rank 0's cache hits), equal to
    the whole tower's in this process (1e-4: the split sums in another order)."""
    client = VisionEncoderClient(address, auth=INTERNAL_AUTH)
    prefill = Prefill(vision_model.config.vision.out_hidden_size)
    try:
        images = [image_bytes(w, h, seed=s) for s, (w, h) in enumerate([(70, 98), (56, 56)])]
        spans = spans_for(image_processor, [*images, images[0]])
        num_rows = sum(s.span.length for s in spans)
        expected = torch.cat(reference_rows(vision_model, image_processor, [*images, images[0]]))
        for call in ("first", "again"):
            destination = prefill.destination(call, 0, num_rows)
            results = await client.encode(call, spans, destination, timeout_s=60)
            assert [r.status for r in results] == [SpanStatus.WRITTEN] * 3
            assert [r.is_cache_hit for r in results] == [call == "again"] * 2 + [True]
            rows = prefill.buffer.rows(0, num_rows)
            torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)
            prefill.buffer.tensor.fill_(float("nan"))
    finally:
        await client.close()
        prefill.close()


def test_a_rank_that_cannot_start_is_one_clear_error() -> None:
    cmd = encoder_command("--transfer-backend shm --devices cpu,cuda:5")
    done = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, env=ENV, timeout=READY_TIMEOUT_S
    )
    assert done.returncode == 1 and "READY" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vision_encoder: error: vision encoder rank 1: rank 0 (cuda:5, pid "), (
        last
    )
    assert "failed to start at device: RuntimeError: cuda:5: CUDA is not available" in last
