"""What decode issues and accepts on the KV path: capped reservations, signed KvRefs, written
proofs."""

from __future__ import annotations

import time

import pytest

from services.common import signing
from services.common.client import create_channel
from services.common.errors import InvalidRequestError, NotFoundError
from services.common.pb.stageserve.v1 import decode_pb2, decode_pb2_grpc
from services.common.types import SamplingParams
from services.decode.__main__ import parse_config
from tests.decode.conftest import KEY, WAIT_S, MakeDecode, prompt_of

YEAR_S = 365 * 24 * 3600.0


async def test_a_year_long_reservation_expires_at_the_cap(make_decode: MakeDecode) -> None:
    harness = await make_decode(reservation_timeout_s=0.2, max_reservation_s=0.5)
    start = harness.num_start_free_pages
    before_ms = time.time() * 1000
    kv_ref = await harness.reserve(
        "r", prompt_of(8, 1), SamplingParams(max_new_tokens=12), deadline_in_s=YEAR_S
    )
    assert (
        before_ms + 500 - 1 <= kv_ref.expires_unix_ms <= time.time() * 1000 + 500
    )  # the cap, not the year
    assert harness.stats().num_used_pages == 5
    await harness.wait_for(lambda: harness.stats().num_reserved_requests == 0)
    stats = harness.stats()
    assert (stats.num_free_pages, stats.num_used_pages, stats.num_quarantined_pages) == (
        start - 5,
        0,
        5,
    )
    with pytest.raises(NotFoundError, match="unknown, expired or aborted"):
        async for _ in harness.generate(kv_ref, 7):
            pass
    await harness.pass_quarantine()
    assert harness.stats().num_free_pages == start


async def test_a_reserve_without_deadline_lives_reservation_timeout_s(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode(reservation_timeout_s=0.3, max_reservation_s=100.0)
    channel = create_channel(harness.client.address)
    try:
        request = decode_pb2.ReserveRequest(
            request_id="r", prompt_token_ids=prompt_of(4, 1)
        )  # no deadline
        before_ms = time.time() * 1000
        reply = await decode_pb2_grpc.DecodeStub(channel).Reserve(request, timeout=WAIT_S)
    finally:
        await channel.close()
    assert before_ms + 300 - 1 <= reply.kv_ref.expires_unix_ms <= time.time() * 1000 + 300
    await harness.wait_for(lambda: harness.stats().num_reserved_requests == 0)


async def test_decode_signs_each_kv_ref_with_a_fresh_nonce(make_decode: MakeDecode) -> None:
    harness = await make_decode()
    params = SamplingParams(max_new_tokens=4)
    a = await harness.reserve("a", prompt_of(4, 1), params)
    b = await harness.reserve("b", prompt_of(4, 1), params)
    assert a.has_valid_mac(KEY) and b.has_valid_mac(KEY)
    assert not a.has_valid_mac(signing.key_of("another-token"))
    assert a.request_id == "a" and len(a.nonce) == signing.NONCE_BYTES and a.nonce != b.nonce
    for request_id in ("a", "b"):
        assert await harness.client.abort(request_id, "test")


async def test_generate_without_the_written_proof_is_refused_and_the_reservation_kept(
    make_decode: MakeDecode,
) -> None:
    harness = await make_decode()
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = prompt_of(8, 1)
    kv_ref = await harness.reserve("r", prompt, params)
    other = await harness.reserve("other", prompt_of(5, 2), params)
    used = harness.stats().num_used_pages
    forged = {
        "missing": b"",
        "garbage": b"\x00" * 32,
        "another reservation's": signing.kv_written_proof(KEY, "other", other.nonce),
        "another key's": signing.kv_written_proof(
            signing.key_of("another-token"), "r", kv_ref.nonce
        ),
        "the empty key's": signing.kv_written_proof(b"", "r", kv_ref.nonce),
    }
    for name, proof in forged.items():
        with pytest.raises(InvalidRequestError, match="kv_written_proof") as caught:
            async for _ in harness.client.generate(
                "r", 7, timeout_s=WAIT_S, kv_written_proof=proof
            ):
                pass
        assert caught.value.param == "kv_written_proof", name
    stats = harness.stats()
    assert (stats.num_reserved_requests, stats.num_running_requests, stats.num_used_pages) == (
        2,
        0,
        used,
    )
    first = harness.prefill.prefill(
        "r", prompt, params, kv_ref
    )  # the KV lands: the real proof starts it
    chunks = [c async for c in harness.generate(kv_ref, first)]
    assert chunks[-1].finish_reason is not None
    assert await harness.client.abort("other", "never written")  # quarantined, then back (fixture)
    await harness.pass_quarantine()
    await harness.wait_all_pages_free()


def test_max_reservation_s_is_a_flag_and_bounds_the_default_lifetime(capsys) -> None:
    assert parse_config([]).max_reservation_s == 300.0
    assert parse_config(["--max-reservation-s", "90"]).max_reservation_s == 90.0
    with pytest.raises(SystemExit):
        parse_config(["--max-reservation-s", "0"])
    assert "argument --max-reservation-s: must be > 0, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--reservation-timeout-s", "120", "--max-reservation-s", "60"])
    err = capsys.readouterr().err
    assert "--reservation-timeout-s (120.0) must be <= --max-reservation-s (60.0)" in err
