"""Domain types that cross service boundaries (inside the process; clients convert to protobuf).

All are frozen ``msgspec.Struct`` so they are cheap, typed and round-trip through
msgpack for tests and logs. Tensors never appear here. ``SamplingParams.validate`` is the one
owner of the sampling fields' ranges, ``finish_reason`` the one stop rule.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection

import msgspec

from services.common.errors import InvalidRequestError


class TextPart(msgspec.Struct, frozen=True, tag="text"):
    text: str


class ImagePart(msgspec.Struct, frozen=True, tag="image"):
    data: bytes  # the compressed image bytes (PNG, JPEG, ...), already fetched by the router


class ImageHeader(msgspec.Struct, frozen=True, tag="image_header"):
    """An image part as the tokenizer's worker processes see it: its hash and size, read in
    the server process, so the compressed bytes never cross into a worker and back."""

    content_hash: str
    height: int = 0
    width: int = 0
    error: str = ""  # why the header could not be read; raised where the image is tokenized


ContentPart = TextPart | ImagePart | ImageHeader


class ChatMessage(msgspec.Struct, frozen=True):
    role: str  # system | user | assistant
    content: tuple[ContentPart, ...]


class ImageSpanRef(msgspec.Struct, frozen=True):
    """An image's placeholder run in a prompt (request-global token offset)."""

    offset: int
    length: int
    content_hash: str  # SHA-256 hex of the compressed bytes
    grid_thw: tuple[int, int, int]  # patch grid before the 2x2 merge


class TokenizedPrompt(msgspec.Struct, frozen=True):
    token_ids: tuple[int, ...]
    spans: tuple[ImageSpanRef, ...] = ()
    images: dict[str, bytes] = {}  # content_hash -> compressed bytes, each distinct image once
    mrope_position_delta: int = 0
    # [len(token_ids), hidden] little-endian rows replacing the token embeddings (the token ids
    # are placeholders then); b"" = none
    prompt_embeds: bytes = b""
    prompt_embeds_dtype: str = ""  # "float32" | "bfloat16" | "float16" when prompt_embeds is set


class GrammarKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON that validates against ``Grammar.spec``
    REGEX = "regex"  # text the regular expression ``spec`` matches in full (xgrammar's dialect)
    EBNF = "ebnf"  # text of the EBNF (GBNF) grammar ``spec``, from its rule ``root``
    # xgrammar's structural tag, ``spec`` its JSON ({"type": "structural_tag", "format": ...}
    # or the older {"type": "structural_tag", "structures": [...], "triggers": [...]})
    STRUCTURAL_TAG = "structural_tag"


class Grammar(msgspec.Struct, frozen=True):
    """A grammar the output must follow (structured outputs), compiled by xgrammar."""

    kind: GrammarKind
    spec: str = ""  # the schema, regex, EBNF or structural tag; "" for JSON_OBJECT
    is_strict: bool = False  # JSON_SCHEMA: no properties or items beyond those the schema names


class SamplingParams(msgspec.Struct, frozen=True):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids distinct
    return_logprobs: bool = False  # each generated token's logprob (raw model log-softmax)
    num_top_logprobs: int = 0  # with return_logprobs: the most likely tokens' logprobs too
    grammar: Grammar | None = None  # None: free text
    num_prompt_logprobs: int = -1  # -1: off; else each prompt token's logprob and top-k ones

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` (with ``param``) for the first field out of its range.

        The one owner of the sampling rules: both router APIs, prefill and decode call it.
        Every range is bounded, so NaN and infinities fail too.
        """
        for param, low, high, is_low_open in _FLOAT_RANGES:
            value = getattr(self, param)
            if not (low < value <= high if is_low_open else low <= value <= high):  # False for NaN
                bound = f"{'(' if is_low_open else '['}{low:g}, {high:g}]"
                raise InvalidRequestError(f"{param} must be in {bound}, got {value!r}", param=param)
        int_checks: list[tuple[bool, str, str]] = [
            (
                0 <= self.top_k <= MAX_TOP_K,
                "top_k",
                f"must be in [0, {MAX_TOP_K}] (0 disables top-k)",
            ),
            (0 < self.max_new_tokens < 2**32, "max_new_tokens", "must be in [1, 2**32)"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed", "must be in [0, 2**64)"),
            (
                all(0 <= t < 2**32 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be in [0, 2**32)",
            ),
            (
                0 <= self.min_tokens <= self.max_new_tokens,
                "min_tokens",
                "must be in [0, max_new_tokens]",
            ),
            (
                0 <= self.num_top_logprobs <= MAX_TOP_LOGPROBS,
                "num_top_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
            (
                self.return_logprobs or self.num_top_logprobs == 0,
                "num_top_logprobs",
                "needs return_logprobs",
            ),
            (
                -1 <= self.num_prompt_logprobs <= MAX_TOP_LOGPROBS,
                "num_prompt_logprobs",
                f"must be in [-1, {MAX_TOP_LOGPROBS}] (-1 disables prompt logprobs)",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"takes at most {MAX_LOGIT_BIAS} tokens",
            ),
        ]
        for is_ok, param, rule in int_checks:
            if not is_ok:
                value = getattr(self, param)
                raise InvalidRequestError(f"{param} {rule}, got {value!r}", param=param)
        self._validate_logit_bias()
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        grammar = self.grammar
        if grammar is None:
            return
        has_spec = grammar.kind is not GrammarKind.JSON_OBJECT
        if has_spec != bool(grammar.spec) or len(grammar.spec) > MAX_GRAMMAR_SPEC_LEN:
            raise InvalidRequestError(
                f"grammar: a {grammar.kind.value} grammar takes "
                + (f"a spec of 1 to {MAX_GRAMMAR_SPEC_LEN} characters" if has_spec else "none"),
                param="grammar",
            )
        if grammar.is_strict and grammar.kind is not GrammarKind.JSON_SCHEMA:
            raise InvalidRequestError(
                "grammar: is_strict applies to json_schema grammars only, "
                f"not {grammar.kind.value}",
                param="grammar",
            )
        if self.ignore_eos or self.min_tokens:
            raise InvalidRequestError(
                "grammar: ignore_eos and min_tokens cannot be combined with a grammar "
                "(the grammar decides where EOS may come)",
                param="ignore_eos" if self.ignore_eos else "min_tokens",
            )

    def _validate_logit_bias(self) -> None:
        token_ids = [token_id for token_id, _ in self.logit_bias]
        if len(set(token_ids)) != len(token_ids):
            raise InvalidRequestError("logit_bias names a token twice", param="logit_bias")
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id < 2**32:
                raise InvalidRequestError(
                    f"logit_bias token ids must be >= 0, got {token_id}", param="logit_bias"
                )
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError(
                    f"logit_bias values must be in [-100, 100], got {bias!r}", param="logit_bias"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """``InvalidRequestError`` when a token id of these params is outside the vocabulary."""
        for param, token_ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
        ):
            if any(t >= vocab_size for t in token_ids):
                raise InvalidRequestError(f"{param} token ids must be < {vocab_size}", param=param)


MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_TOP_LOGPROBS = 20  # most top logprobs per token (OpenAI's and vLLM's bound)
MAX_GRAMMAR_SPEC_LEN = 64 * 1024  # characters of one grammar spec (schema, regex, EBNF, tag)
MAX_TOP_K = 2**31 - 1  # any top_k at or above the vocabulary size keeps every token
# (field, low, high, is the low end open): every float field's range.
_FLOAT_RANGES: tuple[tuple[str, float, float, bool], ...] = (
    ("temperature", 0.0, 2.0, False),
    ("top_p", 0.0, 1.0, True),
    ("min_p", 0.0, 1.0, False),
    # Logits are divided by it: a penalty near 0 turns them into inf (NaN probabilities).
    ("repetition_penalty", 0.01, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("presence_penalty", -2.0, 2.0, False),
)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One generated token's logprob and the most likely tokens' (``SamplingParams`` asks).

    Raw model logprobs: the log-softmax of the logits the sampler got, before penalties,
    logit bias, temperature and filters. ``top_token_ids`` by logprob, descending.
    """

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()  # parallel to top_token_ids


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


def finish_reason(
    params: SamplingParams,
    token_id: int,
    num_prompt_tokens: int,
    num_output_tokens: int,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> FinishReason | None:
    """Whether ``token_id``, the request's ``num_output_tokens``-th output token, ends it.

    STOP: a stop token, or an EOS id unless ``ignore_eos``; neither stops while at most
    ``min_tokens`` tokens were generated (the sampler masks them until then). LENGTH:
    ``max_new_tokens`` generated, or prompt and output fill ``max_model_len``. STOP wins.
    """
    is_stop_token = token_id in params.stop_token_ids or (
        not params.ignore_eos and token_id in eos_token_ids
    )
    if is_stop_token and num_output_tokens > params.min_tokens:
        return FinishReason.STOP
    if num_output_tokens >= params.max_new_tokens:
        return FinishReason.LENGTH
    if num_prompt_tokens + num_output_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


class Usage(msgspec.Struct, frozen=True):
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_image_tokens: int = 0  # image tokens whose embeddings came from the encoder's cache
    num_prefix_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_prefix_cached_image_tokens: int = 0  # the image tokens among them
