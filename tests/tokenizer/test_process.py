"""``python -m services.tokenizer`` as an OS process: READY line, health, a call, SIGTERM -> exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys

import grpc
import pytest

from services.common.client import create_channel, wait_ready
from services.common.clients.tokenizer import TokenizerClient
from services.common.errors import CredentialsRefusedError
from services.common.pb.stageserve.v1 import tokenizer_pb2_grpc
from services.tokenizer.servicer import SERVICE_NAME
from tests.conftest import INTERNAL_AUTH, REPO, image_bytes
from tests.tokenizer.conftest import TIMEOUT_S, user

READY_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 60.0


@pytest.mark.integration
async def test_ready_serving_and_sigterm(tmp_path):
    stderr = (tmp_path / "stderr.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.tokenizer",
        "--port",
        "0",
        "--num-workers",
        "1",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)).decode()
        match = re.fullmatch(r"READY tokenizer port=(\d+) metrics_port=(\d+)\n", line)
        assert match, (
            f"unexpected first line {line!r}; stderr: {(tmp_path / 'stderr.log').read_text()}"
        )
        address = f"127.0.0.1:{match.group(1)}"
        channel = create_channel(address)
        await wait_ready(channel, TIMEOUT_S)
        await wait_ready(channel, TIMEOUT_S, service=SERVICE_NAME)
        await channel.close()
        client = TokenizerClient(address, auth=INTERNAL_AUTH)
        prompt = await client.tokenize_chat(
            "r", [user(image_bytes(56, 56), "hi")], timeout_s=TIMEOUT_S
        )
        async with client.detokenize_stream(
            "r", timeout_s=TIMEOUT_S
        ) as stream:  # stream-stream carries it too
            text = await stream.send(prompt.token_ids[-3:]) + await stream.finish()
        await client.close()
        assert len(prompt.spans) == 1 and text
        await check_unauthenticated(address)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), EXIT_TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        stderr.close()


async def check_unauthenticated(address: str) -> None:
    """The process requires the token the test session exports: a client without it is refused."""
    anonymous = TokenizerClient(address)
    try:
        with pytest.raises(
            CredentialsRefusedError, match="refused this service's internal credentials"
        ):
            await anonymous.tokenize_prompt("anon", "hi", timeout_s=TIMEOUT_S)
    finally:
        await anonymous.close()
    channel = create_channel(address)
    try:
        call = tokenizer_pb2_grpc.TokenizerStub(channel).Detokenize(timeout=TIMEOUT_S)
        # No message: the refusal answers the call's metadata. A write could race the refusal
        # (the client's own failed write, not the server's status, would then end the call).
        with contextlib.suppress(asyncio.InvalidStateError):  # the server may end it first
            await call.done_writing()
        assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await call.details() == "missing or invalid internal credentials"
    finally:
        await channel.close()
