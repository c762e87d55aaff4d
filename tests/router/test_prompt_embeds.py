"""``prompt_embeds`` on ``/v1/completions`` (vLLM's base64 ``torch.save`` format) and in the gRPC
API (the raw bytes): unpacked once, sent to prefill as rows with placeholder token ids and no
tokenizer call; a malformed tensor is a 400 naming ``prompt_embeds``."""

from __future__ import annotations

import base64
import io

import grpc
import pytest
import torch

from services.common.pb.stageserve.v1 import common_pb2, router_pb2
from tests.router.conftest import MODEL_NAME
from tests.router.test_grpc_api import BOUND_S, stub  # noqa: F401 (a fixture)


def saved(tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


def b64(tensor) -> str:
    return base64.b64encode(saved(tensor)).decode()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_prompt_embeds_reach_prefill_as_rows_without_the_tokenizer(http, cluster, dtype):
    rows = torch.randn(1, 6, 64).to(dtype)  # [1, num_tokens, hidden] is accepted too
    reply = await http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt_embeds": b64(rows)}
    )
    assert reply.status_code == 200, reply.text
    [request] = cluster.prefill.requests
    assert list(request.token_ids) == [0] * 6 and request.prompt_embeds_dtype == str(
        dtype
    ).removeprefix("torch.")
    got = torch.frombuffer(bytearray(request.prompt_embeds), dtype=dtype).reshape(6, 64)
    assert torch.equal(got, rows[0])
    assert not cluster.tokenizer.servicer.requests
    assert reply.json()["usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not base64!", "not valid base64"),
        (base64.b64encode(b"junk").decode(), "not a tensor saved with torch.save"),
        (base64.b64encode(saved({"a": torch.zeros(2, 2)})).decode(), "holds a dict, not a tensor"),
        (b64(torch.zeros(3, 4, dtype=torch.float64)), "dtype float64 is not one of"),
        (b64(torch.zeros(8)), "must be [num_tokens, hidden]"),
        (b64(torch.zeros(0, 64)), "must be [num_tokens, hidden]"),
        (b64(torch.full((2, 64), float("nan"))), "NaN or infinite"),
        (b64(torch.zeros(2, 64).to_sparse()), "not a dense tensor"),
    ],
)
async def test_a_malformed_prompt_embeds_is_a_400_naming_it(http, cluster, value, message):
    reply = await http.post("/v1/completions", json={"model": MODEL_NAME, "prompt_embeds": value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt_embeds" and message in error["message"], error
    assert not cluster.prefill.requests


async def test_prompt_and_prompt_embeds_together_is_a_400(http, cluster):
    body = {"model": MODEL_NAME, "prompt": "hi", "prompt_embeds": b64(torch.zeros(2, 64))}
    reply = await http.post("/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


async def test_grpc_prompt_embeds(stub, cluster):  # noqa: F811
    request = router_pb2.GenerateRequest(
        prompt_embeds=saved(torch.randn(4, 64)),
        sampling_params=common_pb2.SamplingParams(max_new_tokens=3),
    )
    responses = [r async for r in stub.Generate(request, timeout=BOUND_S)]
    assert responses[-1].usage.num_prompt_tokens == 4
    assert len(cluster.prefill.requests[0].prompt_embeds) == 4 * 64 * 4
    bad = router_pb2.GenerateRequest(prompt_embeds=b"junk")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in stub.Generate(bad, timeout=BOUND_S)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


BOMBS = [  # ~1.6 KB each on the wire: stride 0 keeps the storage one element
    (torch.zeros(1).expand(250_000, 2048), "has 250000 rows (tokens)"),
    (torch.zeros(1).expand(2_500_000, 2048), "has 2500000 rows (tokens)"),
    (torch.zeros(1).expand(8, 10**9), "rows have 1000000000 values"),
    (torch.zeros(1).expand(8, 2048), "must be contiguous"),
]


@pytest.mark.parametrize(("tensor", "message"), BOMBS)
async def test_a_prompt_embeds_bomb_is_refused_from_its_header(
    http,
    stub,  # noqa: F811
    cluster,
    tensor,
    message,
):
    reply = await http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt_embeds": b64(tensor)}
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt_embeds" and message in error["message"], error
    bad = router_pb2.GenerateRequest(prompt_embeds=saved(tensor))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [r async for r in stub.Generate(bad, timeout=BOUND_S)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    assert not cluster.prefill.requests
