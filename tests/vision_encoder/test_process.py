"""``python -m services.vision_encoder`` as a process: READY, health SERVING, rows over Mooncake, SIGTERM exit 0."""

from __future__ import annotations

import asyncio
import queue
import signal
import subprocess
import sys
import threading

import grpc
import msgspec
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clients.vision_encoder import SpanStatus, VisionEncoderClient
from services.common.errors import UnavailableError
from services.engine.processing.image import decode_image
from services.transfer.embeddings import EmbeddingBuffer
from tests.conftest import INTERNAL_AUTH, REPO, image_bytes, needs_mooncake
from tests.vision_encoder.conftest import span_input

pytestmark = [pytest.mark.integration, needs_mooncake]
READY_TIMEOUT_S = 120


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip())


def test_process_serves_and_stops_on_sigterm(image_processor, vision_model) -> None:
    cmd = [sys.executable, "-m", "services.vision_encoder", "--port", "0", "--metrics-port", "0",
           "--transfer-backend", "mooncake"]
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        ready = lines.get(timeout=READY_TIMEOUT_S)
        words = ready.split()
        assert words[:2] == ["READY", "vision_encoder"], ready
        fields = dict(w.split("=", 1) for w in words[2:])
        address = f"127.0.0.1:{fields['port']}"
        assert int(fields["metrics_port"]) > 0
        asyncio.run(check_serving(address, image_processor, vision_model))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def check_serving(address: str, image_processor, vision_model) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    client = VisionEncoderClient(address, auth=INTERNAL_AUTH)
    from services.transfer.embeddings_mooncake import MooncakeEmbeddingReceiver

    receiver = MooncakeEmbeddingReceiver()  # this test process plays prefill
    buffer = EmbeddingBuffer(256, vision_model.config.vision.out_hidden_size, torch.float32)
    receiver.register(buffer)
    try:
        data = image_bytes(70, 98, seed=9)
        span = span_input(image_processor, data, 3)
        results = await client.encode("real", [span], receiver.destination("real", 10, 64), timeout_s=30)
        assert results[0].status is SpanStatus.WRITTEN
        processed = image_processor.preprocess(decode_image(data, 1 << 30))
        with torch.inference_mode():
            expected = vision_model.encode_images(processed.pixel_values, [processed.grid_thw])
        assert torch.equal(buffer.rows(13, span.span.length), expected)
        # a destination on a port where no transfer engine listens: the peer is dead
        dead = msgspec.structs.replace(receiver.destination("dead", 0, 64), engine_address="127.0.0.1:9",
                                       session_id="127.0.0.1:9")
        with pytest.raises(UnavailableError):
            await client.encode("dead-peer", [span], dead, timeout_s=30)
    finally:
        await client.close()
        receiver.close()
