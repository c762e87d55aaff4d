"""Prefill writes only through live, unused KvRefs decode issued for the request; it proves the
write.

A refused KvRef is refused before the leader sees the request: no KV sender call (no
connection to any engine), not a byte in decode's pool, nothing held.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from services.common import signing
from services.common.errors import CapacityError, DeadlineExceededError, InvalidRequestError
from services.common.types import SamplingParams
from services.prefill.kv_refs import NonceManager
from tests.prefill.conftest import (
    Harness,
    gate_worker,
    make_case,
    record_sends,
    standard_cases,
)
from tests.prefill.fakes import KEY


def pool_is_untouched(harness: Harness) -> bool:
    pool = harness.decode.pool
    return not pool.k_buffer.any() and not pool.v_buffer.any()


def forgeries(harness: Harness, request_id: str, num_tokens: int) -> dict[str, object]:
    """KvRefs a hostile caller can make from what it sees, for a Prefill of ``request_id``."""
    decode = harness.decode
    real = decode.kv_ref(decode.reserve(request_id, num_tokens))
    victim = decode.reserve("victim", num_tokens)  # another live reservation's pages
    other = decode.kv_ref(decode.reserve("other", num_tokens))
    k, v = real.buffers
    return {
        "another reservation's pages": msgspec.structs.replace(real, page_ids=victim.page_ids),
        "another engine address": msgspec.structs.replace(real, session_id="127.0.0.1:8211"),
        "another buffer address": msgspec.structs.replace(
            real, buffers=(msgspec.structs.replace(k, base_address=k.base_address + 4096), v)
        ),
        "a later expiry": msgspec.structs.replace(
            real, expires_unix_ms=real.expires_unix_ms + 10**10
        ),
        "another request's": other,
        "another request's, relabelled": msgspec.structs.replace(other, request_id=request_id),
        "expired": decode.kv_ref(
            decode.reserve(f"{request_id}-expired", num_tokens), expires_in_s=-1.0
        ),
        "signed with another key": decode.kv_ref(
            real.to_destination(), key=signing.key_of("other")
        ),
        "signed with the empty key": decode.kv_ref(real.to_destination(), key=b""),
        "unsigned": msgspec.structs.replace(real, mac=b""),
    }


async def test_forged_kv_refs_are_refused_before_any_connection_or_write(
    pipeline, harness: Harness
) -> None:
    sends = record_sends(harness)
    case = standard_cases(pipeline)[0]
    request_id, n = case.request.request_id, len(case.prompt.token_ids)
    for name, kv_ref in forgeries(harness, request_id, n).items():
        with pytest.raises(InvalidRequestError) as caught:
            await harness.client.prefill(
                request_id, case.prompt, case.request.params, kv_ref, time.time() + 30
            )
        assert caught.value.param == "kv_ref", name
        assert sends == [] and pool_is_untouched(harness), name
    harness.assert_all_free()
    result, _ = await harness.prefill(case)  # the service keeps serving genuine KvRefs
    assert sends == [request_id] and not pool_is_untouched(harness)
    assert result.kv_written_proof


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("another request's", "issued for request 'other', not 'text'"),
        ("expired", "expired"),
        ("another engine address", "MAC does not verify"),
    ],
)
async def test_each_refusal_says_why(pipeline, harness: Harness, name: str, message: str) -> None:
    case = standard_cases(pipeline)[0]
    kv_ref = forgeries(harness, "text", len(case.prompt.token_ids))[name]
    with pytest.raises(InvalidRequestError, match=message):
        await harness.client.prefill(
            "text", case.prompt, case.request.params, kv_ref, time.time() + 30
        )


async def test_a_replayed_kv_ref_is_refused_and_writes_nothing(pipeline, harness: Harness) -> None:
    sends = record_sends(harness)
    case = standard_cases(pipeline)[0]
    kv_ref = harness.decode.kv_ref(harness.decode.reserve("text", len(case.prompt.token_ids)))
    result = await harness.client.prefill(
        "text", case.prompt, case.request.params, kv_ref, time.time() + 30
    )
    assert result.kv_written_proof == signing.kv_written_proof(KEY, "text", kv_ref.nonce)
    with pytest.raises(InvalidRequestError, match="replay") as caught:
        await harness.client.prefill(
            "text", case.prompt, case.request.params, kv_ref, time.time() + 30
        )
    assert caught.value.param == "kv_ref"
    assert sends == ["text"]
    harness.assert_all_free()


async def test_no_write_starts_after_the_kv_ref_expires(pipeline, harness: Harness) -> None:
    """The request's own deadline is far; its reservation's is near: prefill stops at the nearer."""
    sends = record_sends(harness)
    case = make_case(pipeline, "held", "Hi.", [], SamplingParams())
    kv_ref = harness.decode.kv_ref(
        harness.decode.reserve("held", len(case.prompt.token_ids)), expires_in_s=1.0
    )
    release, plans = gate_worker(harness)
    task = asyncio.create_task(
        harness.client.prefill("held", case.prompt, case.request.params, kv_ref, time.time() + 30)
    )
    while not plans:  # the plan is held before the ranks until the reservation has expired
        await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceededError):
        await asyncio.wait_for(task, timeout=10)
    release()
    while harness.scheduler.num_live:
        await asyncio.sleep(0.01)
    assert sends == ["held"] and pool_is_untouched(harness)  # the rank got 0 s for the write
    harness.assert_all_free()


def test_nonces_are_kept_until_their_expiry_within_a_bound() -> None:
    nonces = NonceManager(max_nonces=2)
    nonces.use(b"a", expires_unix_ms=100, now_unix_ms=0)
    with pytest.raises(InvalidRequestError, match="replay"):
        nonces.use(b"a", expires_unix_ms=100, now_unix_ms=99)
    nonces.use(b"b", expires_unix_ms=200, now_unix_ms=99)
    with pytest.raises(CapacityError, match="max-kv-ref-nonces"):
        nonces.use(b"c", expires_unix_ms=300, now_unix_ms=99)
    nonces.use(b"c", expires_unix_ms=300, now_unix_ms=100)  # "a" expired: dropped, room again
    assert len(nonces) == 2
    nonces.use(b"d", expires_unix_ms=400, now_unix_ms=300)
    assert len(nonces) == 1
