"""``python -m services.tokenizer`` as an OS process: READY line, health, a call, SIGTERM -> exit 0."""

from __future__ import annotations

import asyncio
import re
import signal
import sys

import pytest

from services.common.client import create_channel, wait_ready
from services.common.clients.tokenizer import TokenizerClient
from services.common.errors import CredentialsRefusedError
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
        await client.close()
        assert len(prompt.spans) == 1
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
