"""services/engine/step_inputs.py: a step's requests packed into one attention batch."""

from __future__ import annotations

import pytest
import torch

from services.engine.attention import ForwardMode
from services.engine.kv_cache import KVPageManager, RequestPageTable
from services.engine.model.rope import mrope_positions
from services.engine.step_inputs import (
    StepInput,
    attention_batch,
    decode_batch,
    decode_inputs,
)

PAGE_SIZE = 4


def step_input(request_id: str, prefix_len: int, num_tokens: int) -> StepInput:
    positions, _ = mrope_positions(prefix_len + num_tokens, [], 2)
    return StepInput(
        request_id,
        list(range(10, 10 + num_tokens)),
        positions[:, prefix_len:],
        prefix_len,
    )


@pytest.fixture
def page_table() -> RequestPageTable:
    table = RequestPageTable(KVPageManager(16, PAGE_SIZE))
    table.reserve("spacer", 3)  # the requests' pages do not start at page 0
    table.reserve("a", 6)  # 2 pages
    table.reserve("b", 9)  # 3 pages
    return table


def test_an_extend_batch_has_a_slot_for_every_new_token(page_table: RequestPageTable) -> None:
    inputs = [step_input("a", 2, 4), step_input("b", 0, 9)]
    batch = attention_batch(ForwardMode.EXTEND, inputs, page_table)
    assert (batch.seq_lens, batch.extend_lens, batch.prefix_lens) == ([6, 9], [4, 9], [2, 0])
    assert batch.page_tables == [page_table.pages("a"), page_table.pages("b")]
    a_pages, b_pages = page_table.pages("a"), page_table.pages("b")
    expected = [a_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(2, 6)]
    expected += [b_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(9)]
    assert batch.out_slots.tolist() == expected


def test_both_decode_paths_pack_the_same_batch(page_table: RequestPageTable) -> None:
    inputs = [step_input("a", 5, 1), step_input("b", 8, 1)]  # each one's last position
    via_requests = attention_batch(ForwardMode.DECODE, inputs, page_table)
    packed = decode_inputs(inputs, None, page_table)
    via_tensors = decode_batch(packed, PAGE_SIZE)
    assert packed.input_ids.tolist() == [10, 10]
    assert packed.positions.tolist() == torch.cat([s.positions for s in inputs], dim=1).tolist()
    for batch in (via_requests, via_tensors):
        assert (batch.mode, batch.seq_lens, batch.extend_lens) == (
            ForwardMode.DECODE,
            [6, 9],
            [1, 1],
        )
        a_last = page_table.pages("a")[1] * PAGE_SIZE + 1  # position 5: page 1, offset 1
        b_last = page_table.pages("b")[2] * PAGE_SIZE  # position 8: page 2, offset 0
        assert batch.out_slots.tolist() == [a_last, b_last]
    device_ids = torch.tensor([7, 8])
    assert decode_inputs(inputs, device_ids, page_table).input_ids is device_ids


def test_a_position_past_the_pages_held_is_refused(page_table: RequestPageTable) -> None:
    with pytest.raises(AssertionError, match="outside the request's 2 pages"):
        decode_inputs([step_input("a", 8, 1)], None, page_table)
    with pytest.raises(AssertionError, match="no pages reserved for c"):
        attention_batch(ForwardMode.EXTEND, [step_input("c", 0, 2)], page_table)
