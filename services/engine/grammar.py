"""Structured outputs: grammars compiled by xgrammar, and their token masks on the logits.

Every process that samples (prefill's and decode's ranks) holds one ``GrammarCache`` over the
model directory's tokenizer, and so does the router's compiler process
(``services/router/grammars.py``), which compiles each grammar before admission so that
workers only receive grammars that compile. The mask has one bit per
token of the LM head's vocabulary (``config.text.vocab_size``, not the tokenizer's length):
ids past the tokenizer are never allowed, and EOS only where the grammar is complete.
Outputs are compact JSON (no free whitespace), so a sampled model cannot run on in spaces.
Regexes, EBNF grammars and structural tags compile as xgrammar reads them (a regex matches
the whole output; an EBNF grammar starts at its rule ``root``); a structural tag's JSON schemas
are xgrammar's own (free whitespace allowed). Every kind compiles from xgrammar's printed EBNF
with its character classes rewritten to exclude UTF-16 surrogates, so constrained text is always
UTF-8 (a structural tag's free text outside its tags is as unconstrained as any output).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.common.errors import InvalidRequestError
from services.common.types import Grammar, GrammarKind
from services.engine.config import ModelConfig

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_CACHE_ENTRIES = 256  # compiled grammars one process keeps (least recently used out)
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema's objects and arrays
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar 0.2.9 writes the characters of a length-bounded string as [^"\\\r\n], so raw
# control characters pass, which JSON forbids (json.loads refuses them); its other strings
# exclude U+0000..U+001F. The schema's grammar is compiled from its EBNF with that class fixed.
BOUNDED_STRING_CHARS = r"[^\"\\\r\n]"
JSON_STRING_CHARS = r"[^\0-\x1f\"\\\r\n]"


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(
            "structured outputs need xgrammar: run scripts/install.sh (it installs "
            "xgrammar==0.2.9 without its triton requirement)"
        ) from exc
    return xgrammar


class GrammarCache:
    """Compiled grammars by (kind, spec, strictness), at most ``max_entries``; one thread uses it.

    xgrammar (and its tokenizer view) loads on first use: ``prepare`` loads it ahead.
    """

    def __init__(self, model_dir: str | Path, max_entries: int = GRAMMAR_CACHE_ENTRIES) -> None:
        self.model_dir = Path(model_dir)
        self.max_entries = max_entries
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: collections.OrderedDict[Grammar, Any] = collections.OrderedDict()

    def prepare(self) -> None:
        """Import xgrammar and build the tokenizer's view of the vocabulary (seconds, once)."""
        if self._compiler is not None:
            return
        xgr = _xgrammar()
        from transformers import PreTrainedTokenizerFast

        config = ModelConfig.from_dir(self.model_dir)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer,
            vocab_size=config.text.vocab_size,
            stop_token_ids=list(config.eos_token_ids),
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, grammar: Grammar) -> Any:
        """The compiled grammar; ``InvalidRequestError`` (param ``grammar``) when it cannot be."""
        compiled = self._compiled.get(grammar)
        if compiled is not None:
            self._compiled.move_to_end(grammar)
            return compiled
        self.prepare()
        try:
            compiled = self._compile_new(grammar)
        except RuntimeError as exc:
            reason = str(exc) if isinstance(exc, _SpecError) else _reason(exc)
            raise InvalidRequestError(
                f"grammar: the {_NOUNS[grammar.kind]} cannot be compiled: {reason}",
                param="grammar",
            ) from None
        self._compiled[grammar] = compiled
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
        return compiled

    def _compile_new(self, grammar: Grammar) -> Any:
        """``grammar`` compiled; RuntimeError (xgrammar's) when it cannot be."""
        compiler = self._compiler
        assert compiler is not None
        return compiler.compile_grammar(without_surrogates(ebnf(grammar)))

    def matcher(self, grammar: Grammar) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` at the start of ``grammar``."""
        return _xgrammar().GrammarMatcher(self.compile(grammar))


def ebnf(grammar: Grammar) -> str:
    """``grammar`` as xgrammar's EBNF (its printed form); RuntimeError when it cannot be read."""
    xgr = _xgrammar()
    if grammar.kind is GrammarKind.REGEX:
        return str(xgr.Grammar.from_regex(grammar.spec))
    if grammar.kind is GrammarKind.EBNF:
        return str(xgr.Grammar.from_ebnf(grammar.spec))
    if grammar.kind is GrammarKind.STRUCTURAL_TAG:
        check_schema_depth(grammar.spec, _NOUNS[grammar.kind])
        return str(xgr.Grammar.from_structural_tag(structural_tag(grammar.spec)))
    is_object = grammar.kind is GrammarKind.JSON_OBJECT  # an object, as OpenAI's mode
    spec = JSON_OBJECT_SCHEMA if is_object else grammar.spec
    check_schema_depth(spec)
    text = str(
        xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=grammar.is_strict)
    )
    return text.replace(BOUNDED_STRING_CHARS, JSON_STRING_CHARS)


# UTF-16 surrogates: code points that UTF-8 may not encode (a decoder reads their three bytes as
# three U+FFFD). xgrammar's character classes match them, so "[^x]" or a regex's "." would let a
# sampled model write bytes that are not UTF-8; every class is rewritten without them.
SURROGATES = (0xD800, 0xDFFF)
_CLASS_ESCAPES = {
    "0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27,
}  # fmt: skip
_HEX_DIGITS = {"u": 4, "U": 8}  # \x takes every hex digit that follows, as xgrammar reads it
_HEX = frozenset("0123456789abcdefABCDEF")


def without_surrogates(text: str) -> str:
    """xgrammar's printed EBNF with no character class matching a surrogate: a negated class
    excludes them too, a class's ranges lose them (one of surrogates only is left as written).
    Quoted strings are copied as they are."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == '"':
            end = i + 1
            while text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            out.append(text[i : end + 1])
            i = end + 1
        elif char == "[":
            negated, ranges, i = _read_class(text, i + 1)
            out.append(_class_text(negated, ranges))
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _read_class(text: str, i: int) -> tuple[bool, list[tuple[int, int]], int]:
    """The class whose body starts at ``text[i]``: (negated, ranges, index past its "]")."""
    negated = text[i] == "^"
    i += negated
    ranges: list[tuple[int, int]] = []
    while text[i] != "]":
        low, i = _read_class_char(text, i)
        high = low
        if text[i] == "-" and text[i + 1] != "]":
            high, i = _read_class_char(text, i + 1)
        ranges.append((low, high))
    return negated, ranges, i + 1


def _read_class_char(text: str, i: int) -> tuple[int, int]:
    """One character of a class at ``text[i]`` (escaped or not): (code point, next index)."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    kind = text[i + 1]
    if kind == "x":
        end = i + 2
        while end < len(text) and text[end] in _HEX:
            end += 1
        return int(text[i + 2 : end], 16), end
    if kind in _HEX_DIGITS:
        end = i + 2 + _HEX_DIGITS[kind]
        return int(text[i + 2 : end], 16), end
    return _CLASS_ESCAPES.get(kind, ord(kind)), i + 2


def _class_text(negated: bool, ranges: list[tuple[int, int]]) -> str:
    """The class written back with its surrogates gone (every character escaped)."""
    low, high = SURROGATES
    if negated:
        if not any(a <= low and high <= b for a, b in ranges):
            ranges = [*ranges, SURROGATES]
    else:
        kept: list[tuple[int, int]] = []
        for a, b in ranges:
            kept.extend(r for r in ((a, min(b, low - 1)), (max(a, high + 1), b)) if r[0] <= r[1])
        ranges = kept or ranges
    return "[" + "^" * negated + "".join(_range_text(a, b) for a, b in ranges) + "]"


def _range_text(low: int, high: int) -> str:
    def code(c: int) -> str:
        return f"\\u{c:04x}" if c <= 0xFFFF else f"\\U{c:08x}"

    return code(low) if low == high else f"{code(low)}-{code(high)}"


_NOUNS = {
    GrammarKind.JSON_OBJECT: "JSON schema",
    GrammarKind.JSON_SCHEMA: "JSON schema",
    GrammarKind.REGEX: "regex",
    GrammarKind.EBNF: "EBNF grammar",
    GrammarKind.STRUCTURAL_TAG: "structural tag",
}
# xgrammar's "Check failed: (<C++ condition>) is false: " before a structural tag's error
_CHECK_FAILED = re.compile(r"^Check failed: .*? is false: ")


class _SpecError(RuntimeError):
    """A spec xgrammar is not given, with the reason (no C++ location to strip)."""


def structural_tag(spec: str) -> str:
    """A structural tag's JSON as xgrammar compiles it: the older form (``structures`` and
    ``triggers``, vLLM's) becomes a ``triggered_tags`` format; ``_SpecError`` when that older
    form is malformed (xgrammar checks the rest)."""
    try:
        value = json.loads(spec)
    except ValueError as exc:
        raise _SpecError(f"not JSON: {exc}") from None
    if not isinstance(value, dict) or "structures" not in value:
        return spec
    if set(value) - {"type", "structures", "triggers"} or value.get("type") != "structural_tag":
        raise _SpecError(
            'a tag with structures takes type "structural_tag", structures and triggers only'
        )
    from pydantic import ValidationError

    xgr = _xgrammar()
    try:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in value["structures"]
        ]
        tag = xgr.StructuralTag.from_legacy_structural_tag(items, value["triggers"])
    except (KeyError, TypeError, ValidationError) as exc:
        raise _SpecError(
            "structures must be a list of {begin, schema, end} objects and triggers a list of "
            f"strings ({type(exc).__name__}: {str(exc)[:200]})"
        ) from None
    return tag.model_dump_json(indent=None)


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    _, _, tail = text.partition(": ")
    return _CHECK_FAILED.sub("", tail or text)[:500]


def check_schema_depth(spec: str, noun: str = "JSON schema") -> None:
    """``InvalidRequestError`` when brackets nest deeper than ``MAX_SCHEMA_DEPTH`` (strings
    skipped)."""
    depth = deepest = 0
    in_string = is_escaped = False
    for char in spec:
        if in_string:
            is_escaped = not is_escaped and char == "\\"
            in_string = is_escaped or char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "}]":
            depth -= 1
    if deepest > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(
            f"grammar: the {noun} nests {deepest} levels deep, more than {MAX_SCHEMA_DEPTH}",
            param="grammar",
        )


def apply_grammar_masks(
    logits: torch.Tensor,  # [B, V] float32, changed in place
    matchers: Sequence[tuple[int, Any]],  # (batch row, GrammarMatcher) of the constrained rows
) -> None:
    """Set to -inf the logits each row's grammar does not allow next; other rows untouched.

    A terminated matcher (its request already sampled EOS; the step's token is dropped)
    leaves its row as it is.
    """
    live = [(row, m) for row, m in matchers if not m.is_terminated()]
    if not live:
        return
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [B, ceil(V/32)]
    rows = [row for row, m in live if m.fill_next_token_bitmask(bitmask, row)]
    if rows:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


class GrammarMasks:
    """The token masks of a sampler's constrained rows, step after step: filled on the host by
    xgrammar's batch matcher (its own threads) into pinned memory, uploaded, and applied to the
    logits on their device (xgrammar's kernel on CUDA), on the stream after the step's forward.

    The decode loop calls ``apply`` once the step's forward is queued, so the host fills the
    masks while the device runs that forward.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        xgr = _xgrammar()
        self._batch = xgr.BatchGrammarMatcher()
        self._host = xgr.allocate_token_bitmask(max_rows, vocab_size)  # [R, ceil(V/32)] int32
        self._device_masks: torch.Tensor | None = None
        self._uploaded: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._host = self._host.pin_memory()
            self._device_masks = torch.empty_like(self._host, device=device)
            self._uploaded = torch.cuda.Event()  # the pinned masks may be rewritten after it

    def apply(
        self,
        logits: torch.Tensor,  # [B, V] float32, changed in place
        matchers: Sequence[tuple[int, Any]],  # (batch row, GrammarMatcher) of constrained rows
    ) -> None:
        """Set to -inf the logits each row's grammar does not allow next (as
        ``apply_grammar_masks``); a terminated matcher leaves its row as it is."""
        live = [(row, m) for row, m in matchers if not m.is_terminated()]
        if not live:
            return
        rows = [row for row, _ in live]
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's upload has left the pinned masks
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], self._host, rows)
        masks = self._host
        if self._device_masks is not None:
            count = logits.shape[0]
            self._device_masks[:count].copy_(self._host[:count], non_blocking=True)
            assert self._uploaded is not None
            self._uploaded.record()
            masks = self._device_masks
        _xgrammar().apply_token_bitmask_inplace(logits, masks[: logits.shape[0]], indices=rows)

    def accept(self, matchers: Sequence[Any], token_ids: Sequence[int]) -> None:
        """Each matcher accepts its row's sampled token (a terminated one accepts nothing)."""
        live = [(m, t) for m, t in zip(matchers, token_ids, strict=True) if not m.is_terminated()]
        if not live:
            return
        accepted = self._batch.batch_accept_token([m for m, _ in live], [t for _, t in live])
        rejected = [t for (_, t), ok in zip(live, accepted, strict=True) if not ok]
        assert not rejected, f"tokens {rejected} were sampled outside their grammars"
