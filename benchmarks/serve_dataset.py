"""Prompts for the serving benchmark: random words of an exact length, a ShareGPT file, or
prompts that share prefixes.

ShareGPT format (a local JSON file; nothing is downloaded): a list of
``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}``
(``conversation`` is accepted too). As in vLLM's and sglang's clients: conversations with
fewer than two turns are dropped, the first turn is the prompt and the second the
reference reply, the list is shuffled (by ``--seed``), and a prompt or reply of fewer
than ``MIN_SHAREGPT_TOKENS`` tokens is skipped, as is a pair longer than
``--sharegpt-context-len`` when given. The output length is the reply's token count
unless ``--sharegpt-output-len`` fixes it.

Prefix repetition (vLLM's ``prefix_repetition`` dataset, at its flag names): ``num_prefixes``
random prefixes of ``prefix_len`` tokens, each request one of them (in turn, then shuffled by
``--seed``) followed by a random suffix of ``suffix_len`` tokens, ``output_len`` tokens out: a
shared-system-prompt workload for a prefix cache.

Multi-turn: conversations of ``num_turns`` user turns of ``turn_len`` random tokens each, the
images (``--images-per-request``) in the first turn; each later turn is sent once the previous
one has answered, with the whole history (earlier turns, the server's replies, the images) in
front of it, as a chat client sends it.

Mooncake trace (SGLang's ``mooncake`` dataset, from a local file): JSON lines of
``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``, each hash id a
block of ``block_size`` tokens. A hash id's block is the same random words wherever it appears
(drawn from ``--seed`` and the id), so requests that share leading hash ids share that prefix
token for token; the last block is cut or extended to ``input_length`` tokens. Requests are sent
at their timestamps (relative to the first, times ``slowdown_factor``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.serve_tokens import PromptBuilder, TokenCounter

MIN_SHAREGPT_TOKENS = 2


@dataclass(frozen=True)
class ShareGptSpec:
    path: Path
    output_len: int | None  # None: each reply's token count
    context_len: int | None  # None: no pair is too long


@dataclass(frozen=True)
class PrefixRepetitionSpec:
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int

    @property
    def name(self) -> str:
        return (
            f"prefix_repetition {self.num_prefixes} x {self.prefix_len} prefix tokens "
            f"+ {self.suffix_len}, output {self.output_len}"
        )


@dataclass(frozen=True)
class MultiTurnSpec:
    num_turns: int
    turn_len: int
    output_len: int

    @property
    def name(self) -> str:
        return (
            f"multi_turn {self.num_turns} turns of {self.turn_len} tokens, output {self.output_len}"
        )


@dataclass(frozen=True)
class MooncakeTraceSpec:
    path: Path
    slowdown_factor: float
    block_size: int

    @property
    def name(self) -> str:
        return f"mooncake trace {self.path.name} (x{self.slowdown_factor:g} time)"


@dataclass(frozen=True)
class TraceEntry:
    arrival_s: float  # from the first entry's timestamp, slowed down
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptSpec:
    text: str
    input_len: int  # the text's tokens, counted by the model's tokenizer
    output_len: int  # max_tokens
    arrival_s: float | None = None  # a trace's send time; None: the arrival schedule's


def load_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns, in file order."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) >= 2 and all(_is_turn(t) for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    return pairs


def _is_turn(turn: object) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("value"), str)


async def sharegpt_prompts(
    dataset: ShareGptSpec, num_requests: int, seed: int, counter: TokenCounter
) -> list[PromptSpec]:
    pairs = load_sharegpt(dataset.path)
    order = np.random.default_rng(seed).permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    out: list[PromptSpec] = []
    start = 0
    while start < len(pairs):  # counted in batches: a full ShareGPT file has ~90k conversations
        batch = pairs[start : start + max(64, 2 * (num_requests - len(out)))]
        start += len(batch)
        prompt_lens = await counter.count([prompt for prompt, _ in batch])
        reply_lens = await counter.count([reply for _, reply in batch])
        for (prompt, _), prompt_len, reply_len in zip(batch, prompt_lens, reply_lens, strict=True):
            output_len = dataset.output_len or reply_len
            if prompt_len < MIN_SHAREGPT_TOKENS or output_len < MIN_SHAREGPT_TOKENS:
                continue
            if dataset.context_len is not None and prompt_len + output_len > dataset.context_len:
                continue
            out.append(PromptSpec(prompt, prompt_len, output_len))
            if len(out) == num_requests:
                return out
    raise ValueError(
        f"--dataset-path {dataset.path}: {len(out)} usable conversations, "
        f"fewer than --num-requests {num_requests}"
    )


async def random_prompts(
    input_lens: list[int], output_lens: list[int], rng: np.random.Generator, counter: TokenCounter
) -> list[PromptSpec]:
    builder = await PromptBuilder.create(counter)
    prompts = await builder.prompts(input_lens, rng)
    return [
        PromptSpec(text, count, n) for (text, count), n in zip(prompts, output_lens, strict=True)
    ]


async def prefix_repetition_prompts(
    dataset: PrefixRepetitionSpec,
    num_requests: int,
    rng: np.random.Generator,
    counter: TokenCounter,
) -> list[PromptSpec]:
    builder = await PromptBuilder.create(counter)
    prefixes = await builder.prompts([dataset.prefix_len] * dataset.num_prefixes, rng)
    starts = [prefixes[i % dataset.num_prefixes] for i in range(num_requests)]
    starts = [starts[i] for i in rng.permutation(num_requests)]
    prompts = await builder.extend(starts, [dataset.suffix_len] * num_requests, rng)
    return [PromptSpec(text, count, dataset.output_len) for text, count in prompts]


def load_mooncake_trace(dataset: MooncakeTraceSpec, num_requests: int) -> list[TraceEntry]:
    """The first ``num_requests`` entries of the trace file; ValueError names a bad line."""
    entries: list[TraceEntry] = []
    try:
        lines = dataset.path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--dataset-path {dataset.path}: not readable ({exc})") from exc
    for number, line in enumerate(lines, 1):
        if len(entries) == num_requests:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            entry = TraceEntry(
                float(row["timestamp"]) / 1000,
                int(row["input_length"]),
                int(row["output_length"]),
                tuple(int(h) for h in row["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"--dataset-path {dataset.path}, line {number}: not a Mooncake trace entry "
                f"(timestamp, input_length, output_length, hash_ids): {exc!r}"
            ) from exc
        if entry.input_len < 1 or entry.output_len < 1 or not entry.hash_ids:
            raise ValueError(
                f"--dataset-path {dataset.path}, line {number}: input_length and output_length "
                "must be >= 1, hash_ids not empty"
            )
        entries.append(entry)
    if len(entries) < num_requests:
        raise ValueError(
            f"--dataset-path {dataset.path}: {len(entries)} entries, "
            f"fewer than --num-requests {num_requests}"
        )
    start = min(e.arrival_s for e in entries)
    return [replace(e, arrival_s=(e.arrival_s - start) * dataset.slowdown_factor) for e in entries]


async def mooncake_prompts(
    dataset: MooncakeTraceSpec, num_requests: int, seed: int, counter: TokenCounter
) -> list[PromptSpec]:
    entries = load_mooncake_trace(dataset, num_requests)
    builder = await PromptBuilder.create(counter)
    blocks: dict[int, str] = {}
    for hash_id in sorted({h for e in entries for h in e.hash_ids[:-1]}):
        rng = np.random.default_rng([seed, hash_id])
        [(blocks[hash_id], _)] = await builder.prompts([dataset.block_size], rng)
    heads = [" ".join(blocks[h] for h in e.hash_ids[:-1]) for e in entries]
    counts = await counter.count(heads)
    out = []
    for entry, head, count in zip(entries, heads, counts, strict=True):
        rng = np.random.default_rng([seed, entry.hash_ids[-1]])
        if head and count <= entry.input_len:
            [(text, n)] = await builder.extend([(head, count)], [entry.input_len - count], rng)
        else:  # one block, or the earlier blocks already reach input_length: words from scratch
            [(text, n)] = await builder.prompts([entry.input_len], rng)
        out.append(PromptSpec(text, n, entry.output_len, entry.arrival_s))
    return out
