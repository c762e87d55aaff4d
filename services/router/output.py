"""Token ids to client text for one request: incremental detokenize, then stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from services.common.types import FinishReason, TokenLogprob, Usage
from services.router.stop import StopStringMatcher
from services.router.types import GenerationDelta


class Detokenizer(Protocol):
    def step(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class OutputAssembler:
    """Builds the deltas of one request from its generated token ids.

    ``add_tokens`` consumes ids up to (and including) the one that completes a stop
    string, then reports ``is_finished``; ids after it are ignored, as generation
    stops there.
    """

    def __init__(
        self, detokenizer: Detokenizer, stop: tuple[str, ...], num_prompt_tokens: int
    ) -> None:
        self._detokenizer = detokenizer
        self._stop = StopStringMatcher(stop)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_image_tokens = 0
        self.num_prefix_cached_tokens = 0
        self.num_prefix_cached_image_tokens = 0
        self.num_completion_tokens = 0
        self.finish_reason: FinishReason | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add_tokens(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob] = ()
    ) -> GenerationDelta:
        """The delta for ``token_ids``; final (with finish_reason STOP) if a stop string matched.

        ``logprobs``: parallel to ``token_ids`` (the request asked for them) or empty; the
        delta carries those of the ids it took."""
        assert not self.is_finished, "tokens after the request finished"
        taken: list[int] = []
        texts: list[str] = []
        for token_id in token_ids:
            taken.append(token_id)
            self.num_completion_tokens += 1
            texts.append(self._stop.feed(self._detokenizer.step(token_id)))
            if self._stop.is_stopped:
                self.finish_reason = FinishReason.STOP
                return self._final("".join(texts), tuple(taken), tuple(logprobs[: len(taken)]))
        return GenerationDelta("".join(texts), tuple(taken), logprobs=tuple(logprobs))

    def finish(
        self,
        reason: FinishReason,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprob] = (),
    ) -> GenerationDelta:
        """The last delta: ``token_ids`` ended the request for ``reason`` (EOS, length).

        STOP from a worker means the last id is the stop token (EOS or one of
        ``stop_token_ids``): it counts as generated (its logprob too) but its text is not
        shown, as in vLLM.
        """
        ids = list(token_ids)
        stop_token = ids.pop() if reason is FinishReason.STOP and ids else None
        delta = self.add_tokens(ids, logprobs[: len(ids)])
        if self.is_finished:  # a stop string matched inside token_ids
            return delta
        if stop_token is not None:
            self.num_completion_tokens += 1
            delta = GenerationDelta(
                delta.text, (*delta.token_ids, stop_token), logprobs=tuple(logprobs)
            )
        tail = self._detokenizer.finish()
        text = delta.text + self._stop.feed(tail) if tail else delta.text
        if self._stop.is_stopped:
            reason = FinishReason.STOP
        else:
            text += self._stop.flush()
        self.finish_reason = reason
        return self._final(text, delta.token_ids, delta.logprobs)

    def usage(self) -> Usage:
        return Usage(
            self.num_prompt_tokens,
            self.num_completion_tokens,
            self.num_cached_image_tokens,
            self.num_prefix_cached_tokens,
            self.num_prefix_cached_image_tokens,
        )

    def _final(
        self, text: str, token_ids: tuple[int, ...], logprobs: tuple[TokenLogprob, ...]
    ) -> GenerationDelta:
        return GenerationDelta(text, token_ids, self.finish_reason, self.usage(), logprobs)


def with_prompt(
    delta: GenerationDelta, prompt_token_ids: Sequence[int], prompt_logprobs: Sequence[TokenLogprob]
) -> GenerationDelta:
    """The first ``delta`` carrying the prompt's ids and logprobs (the request asked for them)."""
    return msgspec.structs.replace(
        delta, prompt_token_ids=tuple(prompt_token_ids), prompt_logprobs=tuple(prompt_logprobs)
    )


class DetokenizerFactory(Protocol):
    """A request's detokenizer; ``skip_special_tokens`` false: special tokens' text kept."""

    def __call__(self, *, skip_special_tokens: bool) -> Detokenizer: ...
