"""Incremental detokenization for byte-level BPE tokenizers.

Generated token ids arrive one at a time; their bytes are fed to an incremental UTF-8
decoder, so a character whose bytes are split across tokens comes out once complete.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokenizers import Tokenizer


def byte_level_char_to_byte() -> dict[str, int]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, every
    other byte for the next code point from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char_to_byte = {chr(b): b for b in printable}
    printable_set = set(printable)
    others = [b for b in range(256) if b not in printable_set]
    char_to_byte.update({chr(0x100 + n): b for n, b in enumerate(others)})
    return char_to_byte


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes]:
    # Mirrors the ByteLevel decoder: a token made only of alphabet chars is those bytes;
    # any other token (an added token outside the alphabet) is its own UTF-8.
    char_to_byte = byte_level_char_to_byte()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        if all(ch in char_to_byte for ch in token):
            table[token_id] = bytes(char_to_byte[ch] for ch in token)
        else:
            table[token_id] = token.encode("utf-8")
    return table


class IncrementalDetokenizer:
    """Turns generated token ids, fed one at a time, into text deltas.

    Bytes of a character split across tokens are held until the character is complete;
    an invalid byte sequence becomes U+FFFD as soon as it is known to be invalid, as in
    a full decode. ``"".join(deltas) + finish()`` equals ``TextProcessor.decode(ids)``.
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        special_token_ids: frozenset[int],
        skip_special_tokens: bool,
    ) -> None:
        self._token_bytes = token_bytes
        self._skipped_ids = special_token_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        """Feed one token id; return the text it completes (possibly empty)."""
        if token_id in self._skipped_ids or not 0 <= token_id < len(self._token_bytes):
            return ""
        return self._decoder.decode(self._token_bytes[token_id])

    def finish(self) -> str:
        """End of stream: a trailing incomplete character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)
