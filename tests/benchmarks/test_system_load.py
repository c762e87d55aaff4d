"""The system benchmark's client processes (``benchmarks.system_load``) against the fake
OpenAI-compatible server: one clock for all of them, the chat template's tokens read from the
server's usage, a failing process reported instead of waited for."""

from __future__ import annotations

import pytest

from benchmarks.serve_client import Outcome, RequestRecord
from benchmarks.system_load import Load, merge_runs, run_load, template_tokens
from tests.benchmarks.conftest import TEMPLATE_TOKENS, WORD_TOKENIZER


def record(start_s: float, prompt_tokens: int | None = 13) -> RequestRecord:
    return RequestRecord(
        0, 8, 5, 0, Outcome.OK, start_s=start_s, e2e_s=1.0, prompt_tokens=prompt_tokens
    )


def test_runs_of_several_processes_are_put_on_the_first_ones_clock():
    first = [record(0.0), record(2.0)]
    later = [record(0.5)]  # started 1.5 s after the first process, ran as long
    records, duration_s = merge_runs([(first, 100.0, 5.0), (later, 101.5, 5.0)])
    assert [r.start_s for r in records] == [0.0, 2.0, 2.0]
    assert [r.index for r in records] == [0, 1, 2]
    assert duration_s == 6.5  # the first start to the last end, not the longest process


def test_the_template_is_what_the_server_counted_beyond_the_text():
    records = [record(0.0, 13), record(0.0, 13), record(0.0, 14), record(0.0, None)]
    records.append(RequestRecord(0, 8, 5, 0, Outcome.FAILED, prompt_tokens=99))
    assert template_tokens(records, 8) == 5  # the median of the successful ones
    with pytest.raises(RuntimeError, match="no successful request"):
        template_tokens([record(0.0, None)], 8)
    with pytest.raises(RuntimeError, match="counted 20 prompt tokens for 8"):
        template_tokens([record(0.0, 20)], 8)


def test_client_processes_share_the_load_and_the_clock(base_url, state):
    load = Load(base_url, "fake-model", 4, 8, 8, 5, WORD_TOKENIZER, seed=3)
    records, duration_s = run_load(load, 2)
    assert len(records) == 8 and len(state.bodies) == 8
    assert all(r.outcome is Outcome.OK for r in records)
    assert sorted(r.index for r in records) == list(range(8))
    assert all(0.0 <= r.start_s and r.start_s + r.e2e_s <= duration_s for r in records)
    assert template_tokens(records, 8) == TEMPLATE_TOKENS


def test_a_failing_client_process_fails_the_run(base_url, tmp_path):
    load = Load(base_url, "fake-model", 2, 4, 8, 5, tmp_path / "missing.json", seed=3)
    with pytest.raises(RuntimeError, match="client 0: .*missing.json"):
        run_load(load, 2)
