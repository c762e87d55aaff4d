"""HMAC-SHA256 over canonical msgpack tuples: the same fields and key verify, nothing else does."""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from services.common import signing

KEY = signing.key_of("a-secret")
FIELDS = ("req-1", "mooncake", "10.0.0.1:7000", 0, (3, 1, 2), b"\x01" * 16, 1_700_000_000_000)


def test_a_mac_is_hmac_sha256_of_the_msgpack_tuple() -> None:
    expected = hmac.new(
        b"a-secret", msgspec.msgpack.encode(("kv-ref", *FIELDS)), hashlib.sha256
    ).digest()
    assert signing.sign(KEY, signing.KV_REF, FIELDS) == expected and len(expected) == 32
    assert signing.verify(KEY, signing.KV_REF, FIELDS, expected)


def test_another_key_purpose_or_field_does_not_verify() -> None:
    mac = signing.sign(KEY, signing.KV_REF, FIELDS)
    assert not signing.verify(signing.key_of("another"), signing.KV_REF, FIELDS, mac)
    assert not signing.verify(KEY, signing.KV_WRITTEN, FIELDS, mac)
    assert not signing.verify(KEY, signing.KV_REF, (*FIELDS[:4], (3, 2, 1), *FIELDS[5:]), mac)
    assert not signing.verify(KEY, signing.KV_REF, FIELDS, mac[:-1])
    assert not signing.verify(KEY, signing.KV_REF, FIELDS, b"")


def test_the_empty_secret_is_a_working_key_of_its_own() -> None:
    assert signing.key_of("") == b""
    mac = signing.sign(b"", signing.KV_REF, FIELDS)
    assert signing.verify(b"", signing.KV_REF, FIELDS, mac) and not signing.verify(
        KEY, signing.KV_REF, FIELDS, mac
    )


def test_nonces_are_fresh_128_bit_values_and_the_written_proof_binds_request_and_nonce() -> None:
    a, b = signing.new_nonce(), signing.new_nonce()
    assert len(a) == len(b) == signing.NONCE_BYTES == 16 and a != b
    proof = signing.kv_written_proof(KEY, "req-1", a)
    assert proof == signing.sign(KEY, signing.KV_WRITTEN, ("req-1", a))
    assert proof not in (
        signing.kv_written_proof(KEY, "req-2", a),
        signing.kv_written_proof(KEY, "req-1", b),
    )
