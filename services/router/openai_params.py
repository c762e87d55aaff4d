"""A generation body's fields, checked, into ``SamplingParams``, a token budget and stop strings.

The order of checks: ``n`` below 1 (meaningless, not unsupported) or over the router's
``--max-n``, fields this server does not implement (each body's ``REFUSALS``: a 400
naming the field and saying what is not supported), then stream options, the token budget,
logit_bias, the one output constraint (``structured_output``), and last the sampling
ranges of ``SamplingParams.validate`` (the same rules for HTTP and gRPC). The context check
of ``max_tokens`` needs the prompt's length, so the pipeline makes it after tokenizing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import (
    MAX_GRAMMAR_SPEC_LEN,
    MAX_TOP_LOGPROBS,
    Grammar,
    GrammarKind,
    SamplingParams,
)
from services.router.openai_schema import (
    ChatCompletionBody,
    CompletionBody,
    check_text,
)

GenerationBody = ChatCompletionBody | CompletionBody
MAX_NEW_TOKENS = 2**32 - 1  # SamplingParams' bound; a larger max_tokens fails the context check
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only: no sign, space or underscore


@dataclass(frozen=True)
class GenerationOptions:
    """What a body asks for, checked: sampling parameters, token budget and stop strings."""

    params: SamplingParams
    max_tokens: int | None  # None: the router's default
    max_tokens_param: str  # the field that set it: max_tokens or max_completion_tokens
    stop: tuple[str, ...]
    num_choices: int  # n
    grammar_param: str = "response_format"  # the field that set ``params.grammar``, if one did
    skip_special_tokens: bool = True  # false: special tokens stay in the output text


def refuse_unsupported(body: GenerationBody) -> None:
    """``InvalidRequestError`` naming the first field whose value asks for what is not built."""
    for field, is_honoured, reason in body.REFUSALS:
        if not is_honoured(getattr(body, field)):
            raise InvalidRequestError(f"{field}: {reason}", param=field)


def generation_options(
    body: GenerationBody, max_stop_strings: int, max_n: int
) -> GenerationOptions:
    """Check the fields every generation endpoint shares; ``InvalidRequestError`` on the first bad
    one."""
    if body.n is not None and body.n < 1:
        raise InvalidRequestError(f"n must be >= 1, got {body.n}", param="n")
    if body.n is not None and body.n > max_n:
        raise InvalidRequestError(
            f"n must be <= {max_n} (this server's --max-n), got {body.n}", param="n"
        )
    refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    max_tokens_param, max_tokens = _max_tokens(body)
    if body.min_tokens is not None and max_tokens is not None and body.min_tokens > max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
            param="min_tokens",
        )
    grammar, grammar_param = structured_output(body)
    fields: dict[str, Any] = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens,
        "top_k": 0 if body.top_k == -1 else body.top_k,  # -1 = off, as in vLLM
        "seed": None if body.seed is None else body.seed % 2**64,  # OpenAI seeds may be negative
    }
    params = SamplingParams(
        **{k: v for k, v in fields.items() if v is not None},
        ignore_eos=body.ignore_eos,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logit_bias=logit_bias(body.logit_bias),
        **_logprobs(body),
        grammar=grammar,
        # The pipeline sets the real budget; this one bounds min_tokens meanwhile.
        max_new_tokens=min(max_tokens or MAX_NEW_TOKENS, MAX_NEW_TOKENS),
    )
    params.validate()
    stop = _stop_strings(body.stop, max_stop_strings)
    return GenerationOptions(
        params,
        max_tokens,
        max_tokens_param,
        stop,
        body.n or 1,
        grammar_param,
        body.skip_special_tokens,
    )


def _logprobs(body: GenerationBody) -> dict[str, Any]:
    """``SamplingParams``' logprob fields from chat's ``logprobs`` / ``top_logprobs`` or
    completions' ``logprobs``; a 400 naming the field out of its range."""
    if isinstance(body, ChatCompletionBody):
        param, num_top = "top_logprobs", body.top_logprobs
        if num_top is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param=param)
        is_wanted = bool(body.logprobs)
    else:
        param, num_top = "logprobs", body.logprobs
        is_wanted = num_top is not None
    _check_top(param, num_top)
    fields = {"return_logprobs": is_wanted, "num_top_logprobs": num_top or 0}
    if isinstance(body, CompletionBody):
        fields["num_prompt_logprobs"] = _num_prompt_logprobs(body)
    return fields


def _check_top(param: str, num_top: int | None) -> None:
    if num_top is not None and not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}", param=param
        )


def _num_prompt_logprobs(body: CompletionBody) -> int:
    """-1, or the most top logprobs a prompt token needs: echo with ``logprobs`` and vLLM's
    ``prompt_logprobs`` each ask for the prompt's."""
    _check_top("prompt_logprobs", body.prompt_logprobs)
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequestError(
            "prompt_logprobs is not supported with stream: true", param="prompt_logprobs"
        )
    asks = [body.prompt_logprobs]
    if body.echo:
        asks.append(body.logprobs)
    return max((k for k in asks if k is not None), default=-1)


# vLLM's older top-level names: structured_outputs' field each stands for
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


def constraint_fields(body: GenerationBody) -> list[str]:
    """The fields of ``body`` that constrain its output, as a 400 would name them:
    ``response_format`` (unless text), ``structured_outputs.<field>`` and ``guided_*``."""
    found = []
    if body.response_format is not None and body.response_format.get("type") != "text":
        found.append("response_format")
    if body.structured_outputs is not None:
        given = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found += [f"structured_outputs.{name}" for name in _STRUCTURED_FIELDS if name in given]
    found += [name for name in GUIDED_FIELDS if getattr(body, name) is not None]
    return found


def structured_output(body: GenerationBody) -> tuple[Grammar | None, str]:
    """The grammar the body's one output constraint asks for (None: free text) and the field
    that asks; a 400 naming the field, or naming every one when several are set."""
    grammar = response_format(body.response_format)  # a malformed one is a 400 in any case
    fields = constraint_fields(body)
    if len(fields) > 1:
        raise InvalidRequestError(
            f"{' and '.join(fields)} each constrain the output; a request takes one of them",
            param=fields[1],
        )
    so = body.structured_outputs
    if so is not None and not fields:
        raise InvalidRequestError(
            f"structured_outputs must set one of {', '.join(_STRUCTURED_FIELDS)}",
            param="structured_outputs",
        )
    if not fields or fields[0] == "response_format":
        return grammar, "response_format"
    param = fields[0]
    if so is not None:
        name = param.removeprefix("structured_outputs.")
        value = so.json_schema if name == "json" else getattr(so, name)
    else:
        name, value = GUIDED_FIELDS[param], getattr(body, param)
    return _structured_grammar(name, value, param), param


def _structured_grammar(name: str, value: Any, param: str) -> Grammar:
    """The grammar of structured_outputs' field ``name`` (or its guided_* name) set to ``value``."""
    if name == "json":
        return _schema_grammar(_schema(value, param), param, is_strict=False)
    if name == "json_object":
        if value is not True:
            raise InvalidRequestError(
                f"{param} takes only true (leave structured_outputs out for free text)",
                param=param,
            )
        return Grammar(GrammarKind.JSON_OBJECT)
    if name == "choice":
        if not value:
            raise InvalidRequestError(f"{param} must hold at least one string", param=param)
        literals = [
            _ebnf_literal(check_text(text, f"{param}[{i}]")) for i, text in enumerate(value)
        ]
        return Grammar(GrammarKind.EBNF, _spec("root ::= " + " | ".join(literals), param))
    if name == "structural_tag" and not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"))
    kind = {
        "regex": GrammarKind.REGEX,
        "grammar": GrammarKind.EBNF,
        "structural_tag": GrammarKind.STRUCTURAL_TAG,
    }[name]
    if not value:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    return Grammar(kind, _spec(check_text(value, param), param))


def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    """A JSON schema given as an object, a boolean or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, dict | bool):
        raise InvalidRequestError(
            f"{param} must be a JSON schema: an object, a boolean or its JSON text", param=param
        )
    return value


def _spec(text: str, param: str) -> str:
    if len(text) > MAX_GRAMMAR_SPEC_LEN:
        raise InvalidRequestError(
            f"{param} is longer than {MAX_GRAMMAR_SPEC_LEN} characters"
            + (" as a grammar" if param.endswith("choice") else ""),
            param=param,
        )
    return text


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal: quote and backslash escaped, control characters as
    ``\\uHHHH`` (xgrammar's ``\\x`` takes as many hex digits as follow); everything else
    (non-ASCII included) as it is."""
    chars = [
        "\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c
        for c in text
    ]
    return '"' + "".join(chars) + '"'


def _schema_grammar(schema: dict[str, Any] | bool, param: str, *, is_strict: bool) -> Grammar:
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_SPEC_LEN:
        raise InvalidRequestError(
            f"{param}: the schema is longer than {MAX_GRAMMAR_SPEC_LEN} characters as JSON",
            param=param,
        )
    return Grammar(GrammarKind.JSON_SCHEMA, text, is_strict=is_strict)


def response_format(value: dict[str, Any] | None) -> Grammar | None:
    """The grammar ``response_format`` asks for (None: free text); a 400 naming the field."""
    kind = None if value is None else value.get("type")
    if value is None or (kind == "text" and len(value) == 1):
        return None
    if kind == "json_object" and len(value) == 1:
        return Grammar(GrammarKind.JSON_OBJECT)
    if kind != "json_schema" or set(value) != {"type", "json_schema"}:
        raise InvalidRequestError(
            'response_format: only {"type": "text"}, {"type": "json_object"} and '
            '{"type": "json_schema", "json_schema": {...}} are supported',
            param="response_format",
        )
    spec = value["json_schema"]
    if not isinstance(spec, dict) or not set(spec) <= _JSON_SCHEMA_KEYS or "name" not in spec:
        raise InvalidRequestError(
            "response_format: json_schema must be an object with name and optionally schema, "
            "strict and description",
            param="response_format",
        )
    schema, strict = spec.get("schema", {}), spec.get("strict")
    if not isinstance(schema, dict | bool) or not isinstance(strict, bool | None):
        raise InvalidRequestError(
            "response_format: json_schema.schema must be an object and strict a boolean",
            param="response_format",
        )
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_SPEC_LEN:
        raise InvalidRequestError(
            f"response_format: json_schema.schema is longer than {MAX_GRAMMAR_SPEC_LEN} "
            "characters as JSON",
            param="response_format",
        )
    return Grammar(GrammarKind.JSON_SCHEMA, text, is_strict=bool(strict))


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` as (token id, bias) pairs; keys must be decimal ids."""
    pairs = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            shown = key if len(key) <= 20 else key[:20] + "..."
            raise InvalidRequestError(
                f"logit_bias keys must be token ids written as decimal integers, got {shown!r}",
                param="logit_bias",
            )
        pairs.append((int(key), value))
    return tuple(pairs)  # ranges and duplicates ("7" and "07"): SamplingParams.validate


def _max_tokens(body: GenerationBody) -> tuple[str, int | None]:
    """The budget field and its value: > 0, or 0 with completions' echo (the prompt alone,
    as vLLM serves it; the pipeline drops the one token it asks the workers for)."""
    param, value = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        if value is not None and value != body.max_completion_tokens:
            raise InvalidRequestError(
                "max_tokens and max_completion_tokens disagree; send one of them",
                param="max_completion_tokens",
            )
        param, value = "max_completion_tokens", body.max_completion_tokens
    is_completion = isinstance(body, CompletionBody)
    least = 0 if isinstance(body, CompletionBody) and body.echo else 1
    if value is None or value >= least:
        return param, value
    if least == 0:
        raise InvalidRequestError(f"{param} must be >= 0, got {value}", param=param)
    hint = " (0 needs echo: true, which returns the prompt alone)" if is_completion else ""
    raise InvalidRequestError(f"{param} must be > 0, got {value}{hint}", param=param)


def _stop_strings(stop: str | list[str] | None, max_stop_strings: int) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if len(strings) > max_stop_strings:
        raise InvalidRequestError(
            f"stop takes at most {max_stop_strings} strings, got {len(strings)}", param="stop"
        )
    if any(not s for s in strings):
        raise InvalidRequestError("stop strings must not be empty", param="stop")
    params = ["stop"] if isinstance(stop, str) else [f"stop[{i}]" for i in range(len(strings))]
    return tuple(
        dict.fromkeys(check_text(s, param) for s, param in zip(strings, params, strict=True))
    )
