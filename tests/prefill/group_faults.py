"""Steps shared by the rank-group fault tests (``test_cp_faults.py``, ``test_tp_faults.py``):
the service over two CPU rank processes, a greedy text prompt, a prefill that must fail, and
prompts served right afterwards."""

from __future__ import annotations

import time
from typing import Any

import pytest

from services.common.errors import StageServeError
from services.common.types import SamplingParams
from tests.prefill.conftest import (
    Case,
    Harness,
    make_case,
    prefill_config,
    reference,
    start_harness,
)
from tests.prefill.test_service import assert_matches


async def start_two_ranks(
    pipeline,
    language_model,
    step_timeout_s: float = 60.0,  # the config's and the group's default
    tp: int = 1,
    **group: Any,
) -> Harness:
    """Prefill over two CPU rank processes: C = 2 CP ranks, or one TP group with ``tp=2``.
    ``step_timeout_s`` is a step's deadline on the leader and in the rank group."""
    config = prefill_config(devices=("cpu", "cpu"), tp=tp, step_timeout_s=step_timeout_s)
    return await start_harness(
        pipeline, language_model, config, step_timeout_s=step_timeout_s, **group
    )


def text_case(pipeline, request_id: str, text: str) -> Case:
    """A greedy text-only prompt (the id may name a fault the rank step injects)."""
    return make_case(pipeline, request_id, text, [], SamplingParams(temperature=0.0))


async def failed_prefill(h: Harness, case: Case) -> tuple[StageServeError, Any]:
    """Prefill ``case`` through the client into a fresh decode reservation; the call must
    raise. Its error and the reservation."""
    dst = h.decode.reserve(case.request.request_id, len(case.prompt.token_ids))
    with pytest.raises(StageServeError) as caught:
        await h.client.prefill(
            case.request.request_id,
            case.prompt,
            case.request.params,
            h.decode.kv_ref(dst),
            time.time() + 30,
        )
    return caught.value, dst


async def serves_right(h: Harness, pipeline, cases: list[Case]) -> None:
    """Each of ``cases`` prefilled in turn matches the offline reference."""
    for case in cases:
        result, dst = await h.prefill(case)
        assert_matches(h, case, result, dst, reference(pipeline, case))
