"""Token counts for the serving benchmark, and prompts of an exact token count.

Counts come from the model's tokenizer, on the client: a ``tokenizer.json`` (``--tokenizer``: the
file, or a directory holding one), by default the model's (``--model`` as a local directory, or
its ``tokenizer.json`` in the Hugging Face cache; nothing is downloaded). ``--tokenizer server``
counts with the server's ``POST /tokenize`` instead (vLLM's shape; stageserve and vLLM serve
it), one call per text counted. Special tokens are not added, so a count is the text's own
tokens: the server adds the chat template's tokens (chat backend) on top.

Prompts are random words of ``WORDS``. A byte-level BPE pre-tokenizer splits text before
each space, so a prompt's count is the sum of its words' counts (the first word counted
without its leading space). Each word is counted once, a prompt is drawn to the wanted
sum, counted whole, and corrected word by word where a tokenizer merges across words
(at most ``MAX_FIX_ROUNDS`` rounds); the final count is what the request records.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education foot boy age policy music "
    "market sense nation plan college interest death experience effect class control care field "
    "development role effort rate heart drug show leader light voice wife police mind price report "
    "decision son view relationship town road arm difference value building action model season "
    "society tax director position player record paper space ground form event official matter "
    "center couple site project activity star table need court oil situation cost industry figure "
    "street image phone data picture practice piece land product doctor wall patient worker news "
    "test movie north love support technology step baby computer type attention film tree source "
    "organization hair window evidence population blue green red small large early young important "
    "few public bad same able long great little own other old big high different local sure free "
    "better true whole real best hard major clear late"
).split()
MAX_FIX_ROUNDS = 8
MAX_COUNTS_IN_FLIGHT = 16  # concurrent /tokenize calls


class TokenCountError(Exception):
    """Tokens cannot be counted (no tokenizer file, or the server has no usable /tokenize)."""


class TokenCounter(Protocol):
    async def count(self, texts: Sequence[str]) -> list[int]:
        """Each text's token count, special tokens not added."""
        ...


class LocalTokenCounter:
    """A ``tokenizer.json`` (a file, or a model directory holding one) read with ``tokenizers``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise TokenCountError(f"--tokenizer: {file} does not exist")
        self._tokenizer = Tokenizer.from_file(str(file))

    async def count(self, texts: Sequence[str]) -> list[int]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [len(encoding.ids) for encoding in encodings]


class ServerTokenCounter:
    """``POST <url>`` with ``{"model", "prompt", "add_special_tokens": false}`` per text; reads
    ``count``."""

    def __init__(
        self, client: httpx.AsyncClient, url: str, model: str, headers: dict[str, str]
    ) -> None:
        self._client = client
        self._url = url
        self._model = model
        self._headers = headers
        self._slots = asyncio.Semaphore(MAX_COUNTS_IN_FLIGHT)

    async def count(self, texts: Sequence[str]) -> list[int]:
        return list(await asyncio.gather(*(self._count_one(text) for text in texts)))

    async def _count_one(self, text: str) -> int:
        body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        async with self._slots:
            try:
                response = await self._client.post(self._url, json=body, headers=self._headers)
                response.raise_for_status()
                return int(response.json()["count"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                raise TokenCountError(
                    f"cannot count tokens with POST {self._url} ({exc!r}); "
                    "pass --tokenizer with the model's tokenizer.json"
                ) from exc


SERVER_TOKENIZER = "server"  # --tokenizer server: count with POST /tokenize


def model_tokenizer(model: str) -> Path:
    """The ``tokenizer.json`` of ``model``: a local directory (or file), else the Hugging Face
    cache's copy (never downloaded)."""
    local = Path(model).expanduser()
    file = local / "tokenizer.json" if local.is_dir() else local
    if file.is_file():
        return file
    cached = None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "tokenizer.json")
    except (ImportError, ValueError):  # no hub library, or a name that is not a repo id
        pass
    if isinstance(cached, str):
        return Path(cached)
    raise TokenCountError(
        f"no local tokenizer.json for model {model!r} (not a directory, not in the Hugging Face "
        "cache): pass --tokenizer PATH (the model's tokenizer.json or its directory), or "
        "--tokenizer server to count with the server's POST /tokenize"
    )


def tokenize_url(base_url: str) -> str:
    """vLLM and stageserve serve ``/tokenize`` beside ``/v1``, not under it."""
    root = base_url.removesuffix("/v1")
    return f"{root}/tokenize"


class PromptBuilder:
    """Random-word prompts of an exact token count (method in the module docstring)."""

    def __init__(
        self, counter: TokenCounter, first_costs: list[int], later_costs: list[int]
    ) -> None:
        self._counter = counter
        self._first = _WordChoices(first_costs)  # each word at the start of a prompt
        self._later = _WordChoices(later_costs)  # " word" (after a space)

    @classmethod
    async def create(cls, counter: TokenCounter) -> PromptBuilder:
        first = await counter.count(WORDS)
        later = await counter.count([f" {word}" for word in WORDS])
        return cls(counter, first, later)

    async def prompts(
        self, lengths: Sequence[int], rng: np.random.Generator
    ) -> list[tuple[str, int]]:
        """One (text, counted tokens) per wanted length, deterministic in ``rng``."""
        drafts = [self._words(n, [], rng) for n in lengths]
        return await self._fit(drafts, list(lengths), [0] * len(drafts), rng)

    async def extend(
        self, starts: Sequence[tuple[str, int]], extra: Sequence[int], rng: np.random.Generator
    ) -> list[tuple[str, int]]:
        """Each start (a text and its counted tokens, e.g. a shared prefix) followed by random
        words worth ``extra`` more tokens; only the added words are corrected, so every text
        begins with its start unchanged."""
        heads = [text.split() for text, _ in starts]
        lengths = [count + n for (_, count), n in zip(starts, extra, strict=True)]
        drafts = [self._words(n, head, rng) for head, n in zip(heads, extra, strict=True)]
        return await self._fit(drafts, lengths, [len(head) for head in heads], rng)

    async def _fit(
        self,
        drafts: list[list[str]],
        lengths: list[int],
        kept: list[int],  # words at the start of each draft that are never dropped
        rng: np.random.Generator,
    ) -> list[tuple[str, int]]:
        counts = await self._counter.count([" ".join(d) for d in drafts])
        for _ in range(MAX_FIX_ROUNDS):
            wrong = [
                i
                for i, (count, n) in enumerate(zip(counts, lengths, strict=True))
                if count != n and (count < n or len(drafts[i]) > kept[i])
            ]
            if not wrong:
                break
            for i in wrong:
                if counts[i] > lengths[i]:
                    drafts[i] = drafts[i][:-1]
                else:
                    drafts[i] = self._words(lengths[i] - counts[i], drafts[i], rng)
            recounted = await self._counter.count([" ".join(drafts[i]) for i in wrong])
            for i, count in zip(wrong, recounted, strict=True):
                counts[i] = count
        return [(" ".join(d), count) for d, count in zip(drafts, counts, strict=True)]

    def _words(self, num_tokens: int, words: list[str], rng: np.random.Generator) -> list[str]:
        """``words`` extended by random words worth ``num_tokens`` tokens (fewer if none fits)."""
        words = list(words)
        remaining = num_tokens
        while remaining > 0:
            choices = self._later if words else self._first
            index = choices.pick(remaining, rng)
            if index is None:
                break
            words.append(WORDS[index])
            remaining -= choices.costs[index]
        return words


class _WordChoices:
    """Indices of the words that cost at most k tokens, for every k up to the largest cost."""

    def __init__(self, costs: list[int]) -> None:
        self.costs = costs
        self._fitting = [[i for i, c in enumerate(costs) if c <= k] for k in range(max(costs) + 1)]

    def pick(self, max_cost: int, rng: np.random.Generator) -> int | None:
        fitting = self._fitting[min(max_cost, len(self._fitting) - 1)]
        return fitting[int(rng.integers(len(fitting)))] if fitting else None
