"""Stop strings over streamed text, and the per-request output assembly."""

from __future__ import annotations

import pytest

from services.common.types import FinishReason
from services.router.output import OutputAssembler
from services.router.stop import StopStringMatcher
from tests.router.fakes import EOS_ID, TEXT, char_ids


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> str:
    out = []
    for delta in deltas:
        out.append(matcher.feed(delta))
        if matcher.is_stopped:
            return "".join(out)
    return "".join(out) + matcher.flush()


@pytest.mark.parametrize("split", [1, 2, 3, 100])
def test_stop_string_across_deltas(split):
    text = "one two STOP three"
    deltas = [text[i : i + split] for i in range(0, len(text), split)]
    matcher = StopStringMatcher(["STOP"])
    assert feed_all(matcher, deltas) == "one two "
    assert matcher.is_stopped


def test_possible_stop_prefix_is_held_back_then_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == "abc "
    assert matcher.feed("A") == "STA"  # "STA" cannot start "STOP"
    assert matcher.feed("S") == ""
    assert matcher.flush() == "S"
    assert not matcher.is_stopped


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == "hel"


def test_no_stop_strings_passes_text_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("anything") == "anything" and matcher.flush() == ""


def test_overlapping_prefixes_hold_the_longest():
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("xaa") == "x"
    assert matcher.feed("a") == "a"  # "aaa": the last "aa" can still start "aab"
    assert matcher.feed("b") == ""
    assert matcher.is_stopped


def test_output_assembler_counts_tokens_up_to_the_stop_string():
    ids = char_ids("Hi STOP more")
    output = OutputAssembler(TEXT.detokenizer(), ("STOP",), num_prompt_tokens=7)
    first = output.add_tokens(ids[:4])
    assert first.text == "Hi " and first.finish_reason is None
    last = output.add_tokens(ids[4:])
    assert last.finish_reason is FinishReason.STOP and last.text == ""
    assert last.token_ids == tuple(ids[4:7])
    assert last.usage.num_completion_tokens == 7 and last.usage.num_prompt_tokens == 7


def test_output_assembler_finish_skips_eos_text_and_flushes():
    output = OutputAssembler(TEXT.detokenizer(), ("xyz",), num_prompt_tokens=1)
    assert output.add_tokens(char_ids("ab x")).text == "ab "
    last = output.finish(FinishReason.STOP, [EOS_ID])
    assert last.text == "x" and last.finish_reason is FinishReason.STOP
    assert last.usage.num_completion_tokens == 5


def test_output_assembler_text_equals_a_full_decode():
    output = OutputAssembler(TEXT.detokenizer(), (), num_prompt_tokens=1)
    text = "".join(output.add_tokens([i]).text for i in TEXT.encode("héllo wörld"))
    assert text + output.finish(FinishReason.LENGTH).text == "héllo wörld"


def test_output_assembler_hides_the_stop_token_text_but_counts_it():
    """A worker's STOP ends on its stop token (a stop_token_ids member here): not shown, as in
    vLLM."""
    output = OutputAssembler(TEXT.detokenizer(), (), num_prompt_tokens=1)
    assert output.add_tokens(char_ids("ab")).text == "ab"
    last = output.finish(FinishReason.STOP, char_ids("cZ"))
    assert last.text == "c" and last.token_ids == tuple(char_ids("cZ"))
    assert last.usage.num_completion_tokens == 4
    length = OutputAssembler(TEXT.detokenizer(), (), num_prompt_tokens=1)
    assert (
        length.finish(FinishReason.LENGTH, char_ids("cZ")).text == "cZ"
    )  # no stop token: all shown
