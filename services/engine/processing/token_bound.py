"""How many tokens a text needs at least, with work that grows with the context limit,
not with the text: an over-long prompt is refused without tokenizing all of it.

``TokenBound.count_until(pieces, tokenizer, max_len)`` stops as soon as it has proved
that the pieces need ``max_len`` tokens or more. In order: pieces shorter than the
limit are left to the caller's exact encode; a bound from the length alone (facts 1, 2)
refuses most huge texts at once; below it the text is encoded piece by piece between
cuts (fact 3), and a long stretch without a cut is bounded from its normalized length
and the characters it holds (facts 1, 4) before it is encoded. The four facts about a
byte-level BPE tokenizer (``from_tokenizer`` checks the configuration they need):

1. Tokens cover the normalized text: each token is one vocabulary entry or one added
   token and starts at most ``max_token_chars`` code points (its UTF-8 lead bytes, or
   its content for an added token). Every byte has a token, so a text of ``n`` code
   points after normalization needs at least ``n / max_token_chars`` tokens, and at
   least ``n / m`` where ``m`` is the most code points a token starts among those whose
   ASCII bytes all occur in the text (a run of ``x`` admits only runs of ``x``).
2. NFC keeps at least 1/4 of the code points (it composes a character from at most its
   canonical decomposition, 4 code points at most), keeps ASCII text as it is, and the
   ASCII characters of NFC(text) all occur in NFD(text).
3. The pre-tokenizers accepted for cutting (the GPT-2 regex of ``ByteLevel``, and the
   Qwen2 / cl100k ``Split`` patterns) never put, inside one pre-token, a non-space
   followed by a space or tab, nor an ASCII letter or digit followed by CR or LF; NFC
   never composes or reorders across an ASCII character, and no added token holds
   whitespace. So a text cut before such a character (a *cut*) tokenizes as its two
   sides do, and the pieces between cuts are counted exactly, one at a time.
4. NFC never composes or reorders across the characters ``_NFC_SAFE_RE`` matches, so a
   prefix of an uncut stretch that ends before one normalizes on its own: windows cut
   there and normalized by the tokenizer's own normalizer give its exact length.

Lower bounds never exceed the true count, so a prompt that fits is never refused. Work:
at most about ``4 * max_token_chars * max_len`` characters are encoded or normalized,
plus two chunks; beyond that only C-speed scans (a regex looking for the next cut or
NFC-safe character, ``set()`` of a window with no NFC-safe character in reach).
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from tokenizers import Tokenizer, models, normalizers

from services.common.errors import ModelLoadError
from services.engine.processing.detokenize import byte_level_char_to_byte

MAX_COMPOSED = 4  # longest canonical decomposition (U+1F82): NFC composes at most this many
CHUNK_CHARS = 16384  # text counted per encode call, and per step over an uncut stretch
_MAX_WINDOW_CHUNKS = 4  # an uncut window normalized at once holds at most this many chunks

# A cut sits before the matched character (fact 3).
_CUT_RE = re.compile(r"(?<=\S)[ \t\x0b\x0c]|(?<=[A-Za-z0-9])[\r\n]")
# NFC starts afresh before these (fact 4): ASCII, kana, CJK ideographs, Hangul syllables.
_NFC_SAFE_RE = re.compile("[\x00-\x7f\u3041-\u3096\u30a1-\u30fa\u4e00-\u9fff\uac00-\ud7a3]")

# Split patterns whose pre-tokens never hold a cut (fact 3), as tokenizer.json writes them.
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CL100K_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
CUT_SAFE_PATTERNS = frozenset({QWEN2_PATTERN, CL100K_PATTERN})


class TokenCount(NamedTuple):
    num_tokens: int
    is_exact: bool  # False: a lower bound, and at least the max_len it was counted against


_CONTINUATION_BYTES = bytes(range(0x80, 0xC0))


def _num_leads(token: bytes | str) -> int:
    """Code points a token starts: its UTF-8 lead bytes, or an added token's content length."""
    return len(token) if isinstance(token, str) else len(token.translate(None, _CONTINUATION_BYTES))


class _LeadTable:
    """The most code points one token starts, among tokens whose ASCII bytes lie in a set."""

    def __init__(self, tokens: Iterable[bytes | str]) -> None:
        best: dict[tuple[int, bool], int] = {}  # (ASCII mask, has non-ASCII) -> most leads
        for token in tokens:
            codes = [ord(ch) for ch in token] if isinstance(token, str) else token
            key = (sum(1 << c for c in set(codes) if c < 128), any(c >= 128 for c in codes))
            best[key] = max(best.get(key, 0), _num_leads(token))
        self._by_leads = sorted(
            ((leads, mask, other) for (mask, other), leads in best.items()), reverse=True
        )
        self.max_leads_within = functools.lru_cache(maxsize=1024)(self._max_leads_within)

    def _max_leads_within(self, ascii_mask: int, allow_non_ascii: bool) -> int:
        return next(
            (
                leads
                for leads, mask, other in self._by_leads
                if mask & ~ascii_mask == 0 and (allow_non_ascii or not other)
            ),
            0,
        )


def _ascii_mask(text: str) -> int:
    """The ASCII characters of a text, as a bit mask."""
    return sum(1 << ord(ch) for ch in set(text) if ord(ch) < 128)


def _nfd_ascii_mask(text: str) -> int:
    """The ASCII characters NFC(text) can hold (fact 2), as a bit mask."""
    chars = set(text)
    if not text.isascii():
        chars = {d for ch in chars for d in unicodedata.normalize("NFD", ch)}
    return _ascii_mask("".join(chars))


def _ceil_div(a: int, b: int) -> int:
    return max(0, -(-a // b))


def _pre_tokenizer_parts(tokenizer: Tokenizer) -> list[dict[str, Any]]:
    if tokenizer.pre_tokenizer is None:
        return []
    state = json.loads(tokenizer.pre_tokenizer.__getstate__())
    return state.get("pretokenizers", [state])


def _can_cut(parts: list[dict[str, Any]]) -> bool:
    splits = False
    for part in parts:
        kind = part.get("type")
        if kind == "ByteLevel":
            if part.get("add_prefix_space"):
                return False
            splits |= bool(part.get("use_regex"))
        elif kind == "Split":
            pattern = part.get("pattern", {}).get("Regex")
            is_isolated = part.get("behavior") == "Isolated" and not part.get("invert")
            if pattern not in CUT_SAFE_PATTERNS or not is_isolated:
                return False
            splits = True
        elif kind != "Digits":
            return False
    return splits


class TokenBound:
    """Counts the tokens of prompt pieces up to a limit (the module docstring says why it holds)."""

    def __init__(
        self,
        tokens: Sequence[bytes | str],
        normalize: Callable[[str], str],
        max_composed: int,
        can_cut: bool,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        assert chunk_chars >= 2, chunk_chars
        self._tokens = tokens  # every vocabulary token's bytes and added token's content
        self._normalize = normalize
        self.max_token_chars = max(map(_num_leads, tokens))
        self._max_composed = max_composed
        self._cut_re = _CUT_RE if can_cut else None
        self._chunk_chars = chunk_chars

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Tokenizer, token_bytes: Sequence[bytes], chunk_chars: int = CHUNK_CHARS
    ) -> TokenBound:
        """The bound of a byte-level BPE tokenizer (``token_bytes``: each id's bytes).

        Raises ModelLoadError for a tokenizer the bound cannot be proved for. Cutting
        (fact 3) is used only for the pre-tokenizers and added tokens it is proved for;
        without it, long texts are bounded as one uncut stretch (correct, slower).
        """
        is_nfc = isinstance(tokenizer.normalizer, normalizers.NFC)
        if tokenizer.normalizer is not None and not is_nfc:
            raise ModelLoadError(
                f"tokenizer normalizer {type(tokenizer.normalizer).__name__} is not supported "
                "(NFC or none)"
            )
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            raise ModelLoadError("tokenizer.json must not set truncation or padding")
        if not isinstance(tokenizer.model, models.BPE) or tokenizer.model.dropout:
            raise ModelLoadError("only BPE tokenizers without dropout are supported")
        parts = _pre_tokenizer_parts(tokenizer)
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        if not any(p.get("type") == "ByteLevel" for p in parts) or not all(
            ch in vocab for ch in byte_level_char_to_byte()
        ):
            raise ModelLoadError(
                "the tokenizer must pre-tokenize to bytes (ByteLevel) with a token for every byte"
            )
        added = list(tokenizer.get_added_tokens_decoder().values())
        tokens = [*(token_bytes[i] for i in vocab.values()), *(a.content for a in added)]
        plain_added = all(
            not (a.lstrip or a.rstrip or a.single_word or any(ch.isspace() for ch in a.content))
            for a in added
        )
        if is_nfc:
            normalize, max_composed = tokenizer.normalizer.normalize_str, MAX_COMPOSED
        else:
            normalize, max_composed = str, 1
        return cls(tokens, normalize, max_composed, plain_added and _can_cut(parts), chunk_chars)

    @functools.cached_property
    def _leads(self) -> _LeadTable:
        return _LeadTable(self._tokens)  # built on first use: one pass over the vocabulary

    def count_until(
        self, pieces: Sequence[str | int], tokenizer: Tokenizer, max_len: int
    ) -> TokenCount | None:
        """Token count of the pieces (text encoded with ``tokenizer``; an int is one token).

        None when the pieces hold fewer than ``max_len`` characters and tokens: encoding
        them costs no more than a prompt that fits. Otherwise the exact count, or a lower
        bound that is at least ``max_len`` (``is_exact`` False) once the count has passed
        it; the work done is bounded by the limit, whatever the pieces' length.
        """
        texts = [p for p in pieces if isinstance(p, str)]
        num_markers = len(pieces) - len(texts)
        if num_markers + sum(len(t) for t in texts) < max_len:
            return None
        lower = num_markers + sum(self._chars_bound(len(t), t.isascii()) for t in texts)
        if lower >= max_len:
            return TokenCount(lower, False)
        num_tokens = 0
        for piece in pieces:
            if num_tokens >= max_len:
                return TokenCount(num_tokens, False)
            if isinstance(piece, int):
                num_tokens += 1
                continue
            count = self._count_text(piece, tokenizer, num_tokens, max_len)
            if not count.is_exact:
                return count
            num_tokens = count.num_tokens
        return TokenCount(num_tokens, True)

    def _chars_bound(self, num_chars: int, is_ascii: bool, max_leads: int | None = None) -> int:
        composed = 1 if is_ascii else self._max_composed
        return _ceil_div(num_chars, composed * (max_leads or self.max_token_chars))

    def _count_text(
        self, text: str, tokenizer: Tokenizer, num_tokens: int, max_len: int
    ) -> TokenCount:
        pos = 0
        while pos < len(text):
            if num_tokens >= max_len:
                return TokenCount(num_tokens, False)
            end = self._next_cut(text, pos)
            if end is None:  # no cut for a whole chunk: bound the stretch before encoding it
                end, lower = self._bound_uncut(text, pos, max_len - num_tokens)
                if end is None:
                    return TokenCount(num_tokens + lower, False)
            num_tokens += len(tokenizer.encode(text[pos:end], add_special_tokens=False).ids)
            pos = end
        return TokenCount(num_tokens, True)

    def _next_cut(self, text: str, pos: int) -> int | None:
        """The end of the next piece to encode whole: the text's end if it is within a chunk,
        else a cut in (pos, pos + chunk), in its second half if there is one; None if none."""
        if len(text) - pos <= self._chunk_chars:
            return len(text)
        if self._cut_re is None:
            return None
        chunk_end = pos + self._chunk_chars
        near_end = self._cut_re.search(text, pos + self._chunk_chars // 2, chunk_end)
        if near_end is not None:
            return near_end.start()
        half = pos + self._chunk_chars // 2
        cuts = [m.start() for m in self._cut_re.finditer(text, pos + 1, half)]
        return cuts[-1] if cuts else None

    def _bound_uncut(self, text: str, start: int, budget: int) -> tuple[int | None, int]:
        """Walks the stretch from ``start`` (a cut) to the next cut window by window.

        Returns (the next cut or the text's end, a lower bound of the stretch's tokens),
        or (None, a lower bound >= budget) as soon as the stretch certainly holds
        ``budget`` tokens. A window ends before an NFC-safe character (fact 4), so the
        prefix walked so far normalizes on its own and its normalized length is exact;
        the tokens wholly inside it start all but at most 2 * max_token_chars of its code
        points (a token straddling its end; an added token straddling it unnormalized).
        Where no NFC-safe character comes within a few chunks, the window runs to the
        stretch's end and its length is bounded by fact 2 instead of normalized.
        """
        pos, num_normalized, mask, is_ascii = start, 0, 0, True
        while True:
            reach = pos + _MAX_WINDOW_CHUNKS * self._chunk_chars
            safe = _NFC_SAFE_RE.search(text, pos + self._chunk_chars, reach)
            end = safe.start() if safe is not None else min(len(text), reach)
            cut = None
            if self._cut_re is not None:
                cut = self._cut_re.search(text, max(pos, start + 1), end)
                end = cut.start() if cut is not None else end
            is_complete = cut is not None or end == len(text)
            if not is_complete and safe is None:  # no NFC-safe point within reach
                return self._bound_unnormalized(
                    text, start, pos, num_normalized, mask, is_ascii, budget
                )
            window = text[pos:end]
            normalized = self._normalize(window)
            num_normalized += len(normalized)
            mask |= _ascii_mask(window) | _ascii_mask(normalized)
            is_ascii = is_ascii and window.isascii() and normalized.isascii()
            max_leads = self._leads.max_leads_within(mask, not is_ascii)
            if is_complete:
                lower = _ceil_div(num_normalized, max_leads)
                return (end if lower < budget else None), lower
            lower = _ceil_div(num_normalized - 2 * self.max_token_chars, max_leads)
            if lower >= budget:
                return None, lower
            pos = end

    def _bound_unnormalized(
        self,
        text: str,
        start: int,
        pos: int,
        num_normalized: int,
        mask: int,
        is_ascii: bool,
        budget: int,
    ) -> tuple[int | None, int]:
        """``_bound_uncut`` for the rest of a stretch from ``pos`` (NFC-safe), by fact 2."""
        cut = self._cut_re.search(text, max(pos, start + 1)) if self._cut_re is not None else None
        end = cut.start() if cut is not None else len(text)
        window = text[pos:end]
        composed = 1 if window.isascii() else self._max_composed
        is_ascii = is_ascii and window.isascii()
        max_leads = self._leads.max_leads_within(mask | _nfd_ascii_mask(window), not is_ascii)
        lower = _ceil_div(num_normalized * composed + len(window), composed * max_leads)
        return (end if lower < budget else None), lower
