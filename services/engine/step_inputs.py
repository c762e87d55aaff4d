"""What one forward step takes, and its packing into the attention backend's batch.

A step is either a list of ``StepInput`` (each request's new tokens, positions and image
embeddings) or, for a decode loop's DECODE step, one ``DecodeInputs`` of whole-batch
tensors. Both become one ragged ``AttentionBatch`` over the requests' pages in a
``RequestPageTable``: KV lengths, new-token counts, page lists and the KV slot of every new
position. All of it is host bookkeeping; the backend uploads the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import AttentionBatch, ForwardMode
from services.engine.kv_cache import RequestPageTable


@dataclass
class StepInput:
    """One request's part of a step: the tokens at positions ``prefix_len`` ..
    ``prefix_len + len(input_ids) - 1``."""

    request_id: str
    input_ids: list[int]
    positions: torch.Tensor  # [3, len(input_ids)] int64
    prefix_len: int
    image_embeds: torch.Tensor | None = (
        None  # [num_image_tokens, hidden], rows in placeholder order
    )
    image_rows: list[int] | None = None  # index into input_ids of each image embedding row


@dataclass(frozen=True)
class DecodeInputs:
    """One DECODE step as whole-batch tensors: row ``r`` feeds one token at KV position
    ``seq_lens[r] - 1``.

    Built by a decode loop from its own persistent buffers (no per-request objects); the
    page tables are the rows' page lists as held, covering at least ``seq_lens[r]`` positions.
    """

    input_ids: (
        torch.Tensor
    )  # [B] int64, on the runner's device (e.g. the previous step's samples) or CPU
    positions: (
        torch.Tensor
    )  # [3, B] int64 CPU: M-RoPE position of each row's token on the three axes
    seq_lens: list[int]  # KV length of each row after this step
    page_tables: list[list[int]]
    out_slots: torch.Tensor  # [B] int64 CPU: flat KV slot of each row's new position


def attention_batch(
    mode: ForwardMode, inputs: list[StepInput], page_table: RequestPageTable
) -> AttentionBatch:
    """The batch of ``inputs``, whose requests hold their pages in ``page_table``."""
    seq_lens, extend_lens, page_tables, slots = [], [], [], []
    for s in inputs:
        end = s.prefix_len + len(s.input_ids)
        assert s.request_id in page_table, f"no pages reserved for {s.request_id}"
        seq_lens.append(end)
        extend_lens.append(len(s.input_ids))
        page_tables.append(page_table.pages(s.request_id))
        if mode is not ForwardMode.DECODE:
            slots.append(page_table.slots(s.request_id, s.prefix_len, end))
    out_slots = (
        decode_slots(page_tables, seq_lens, page_table.page_size)
        if mode is ForwardMode.DECODE
        else torch.cat(slots)
    )
    return AttentionBatch(
        mode=mode,
        seq_lens=seq_lens,
        extend_lens=extend_lens,
        page_tables=page_tables,
        page_size=page_table.page_size,
        out_slots=out_slots,  # CPU int64; the backend uploads it
    )


def decode_inputs(
    inputs: list[StepInput], input_ids: torch.Tensor | None, page_table: RequestPageTable
) -> DecodeInputs:
    """``DecodeInputs`` of StepInputs whose requests hold pages in ``page_table``;
    ``input_ids`` (if given) replace each StepInput's ``input_ids[0]``."""
    page_tables = [page_table.pages(s.request_id) for s in inputs]
    seq_lens = [s.prefix_len + 1 for s in inputs]
    if input_ids is None:
        input_ids = torch.tensor([s.input_ids[0] for s in inputs], dtype=torch.long)
    return DecodeInputs(
        input_ids,
        torch.cat([s.positions for s in inputs], dim=1),
        seq_lens,
        page_tables,
        decode_slots(page_tables, seq_lens, page_table.page_size),
    )


def decode_batch(inputs: DecodeInputs, page_size: int) -> AttentionBatch:
    """The DECODE batch of ``inputs``: one new token a row."""
    return AttentionBatch(
        mode=ForwardMode.DECODE,
        seq_lens=inputs.seq_lens,
        extend_lens=[1] * len(inputs.seq_lens),
        page_tables=inputs.page_tables,
        page_size=page_size,
        out_slots=inputs.out_slots,
    )


def decode_slots(page_tables: list[list[int]], seq_lens: list[int], page_size: int) -> torch.Tensor:
    """Slot of each request's last position, [B] int64 CPU (plain ints: no tensor per request)."""
    ps = page_size
    slots = []
    for pages, end in zip(page_tables, seq_lens, strict=True):
        assert end <= len(pages) * ps, (
            f"position {end - 1} outside the request's {len(pages)} pages"
        )
        slots.append(pages[(end - 1) // ps] * ps + (end - 1) % ps)
    return torch.tensor(slots, dtype=torch.long)
