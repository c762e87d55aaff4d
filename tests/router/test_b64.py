"""``b64decode_strict`` accepts exactly what ``base64.b64decode(validate=True)`` accepts, returns
the same bytes, and refuses the rest with the standard library's message."""

from __future__ import annotations

import base64
import binascii
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.router.b64 import b64decode_strict


def stdlib(text: str) -> bytes | str:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        return str(exc)


def ours(text: str) -> bytes | str:
    try:
        return b64decode_strict(text)
    except (binascii.Error, ValueError) as exc:
        return str(exc)


@given(st.binary(max_size=300))
def test_valid_base64_decodes_to_its_bytes(data):
    assert b64decode_strict(base64.b64encode(data).decode()) == data


B64_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


@given(st.text(alphabet=B64_CHARS + " \n-_é", max_size=40))
def test_any_text_is_accepted_or_refused_as_the_standard_library_does(text):
    assert ours(text) == stdlib(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("not base64!", "Only base64 data is allowed"),
        ("YWJ", "Incorrect padding"),
        ("ab=c", "Discontinuous padding not allowed"),
        ("é", "string argument should contain only ASCII characters"),
    ],
)
def test_refusals_carry_the_precise_reason(text, message):
    with pytest.raises(ValueError, match=message):
        b64decode_strict(text)


def test_a_large_payload_round_trips():
    data = os.urandom(1_860_000)  # a 1080p noise JPEG's size
    assert b64decode_strict(base64.b64encode(data).decode()) == data
