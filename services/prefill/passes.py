"""One forward pass of a plan on one rank: its inputs, whole or as this rank's CP shard.

Every rank builds the pass's full packed sequence first: token embeddings with the
request's image (or override) rows merged at their request-global positions, and M-RoPE
positions computed on the whole prompt. Only then does a sharded pass keep this rank's
tokens (``CpShard``): nothing is merged after the shard. A Qwen3-VL image row carries its
DeepStack rows after the merged embedding (``ModelConfig.embedding_row_width``); they are
merged in the same step, so each rank's tokens keep their own DeepStack rows (zeros for
text tokens), and the pass is as wide as its widest part.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.attention import AttentionBatch, ForwardMode
from services.engine.attention.context_parallel import CpShard, local_runs
from services.engine.model.rope import ImageSpan, mrope_positions
from services.engine.model_runner import ModelRunner
from services.engine.step_inputs import StepInput
from services.prefill.messages import PassSegment, RankRequest


@dataclass
class RequestRows:
    """A request's prompt as every rank sees it before any shard."""

    positions: torch.Tensor  # [3, num_tokens] int64, the whole prompt
    image_embeds: torch.Tensor | None  # [num_image_tokens, embedding_row_width] in span order
    image_positions: list[int]  # prompt position of each image row
    override: torch.Tensor | None  # [num_tokens, hidden]: replaces the token embeddings


def request_rows(
    request: RankRequest,
    image_embeds: torch.Tensor | None,
    override: torch.Tensor | None,
    spatial_merge_size: int,
) -> RequestRows:
    spans = [ImageSpan(s.offset, s.length, s.grid_thw) for s in request.spans]
    positions, _delta = mrope_positions(request.num_tokens, spans, spatial_merge_size)
    image_positions = [s.offset + i for s in request.spans for i in range(s.length)]
    return RequestRows(positions, image_embeds, image_positions, override)


def chunk_input(request: RankRequest, rows: RequestRows, start: int, end: int) -> StepInput:
    """Tokens ``[start, end)`` as an EXTEND input over the prefix ``[0, start)``."""
    # image rows are in prompt order: the chunk's are one run of them
    lo = bisect.bisect_left(rows.image_positions, start)
    hi = bisect.bisect_left(rows.image_positions, end)
    embeds = rows.image_embeds[lo:hi] if hi > lo and rows.image_embeds is not None else None
    return StepInput(
        request.request_id,
        list(request.token_ids[start:end]),
        rows.positions[:, start:end],
        start,
        embeds,
        [p - start for p in rows.image_positions[lo:hi]] or None,
    )


def merged_embeds(
    runner: ModelRunner, request: RankRequest, rows: RequestRows, start: int, end: int
) -> torch.Tensor:
    """[end - start, hidden], or [end - start, embedding_row_width] when a DeepStack image
    row is among them: token embeddings with image or override rows merged in."""
    device = runner.device
    if rows.override is not None:
        return rows.override[start:end].to(device=device, dtype=runner.dtype)
    step = chunk_input(request, rows, start, end)
    ids = torch.tensor(step.input_ids, dtype=torch.long, device=device)
    if step.image_embeds is None or not step.image_rows:
        return runner.model.embed(ids)
    row_index = torch.tensor(step.image_rows, dtype=torch.long, device=device)
    return runner.model.embed(ids, step.image_embeds.to(device), row_index)


def widened_cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` ([n_i, width_i]) stacked, each padded with zero columns to the widest: a
    text part's missing DeepStack rows are zeros."""
    width = max(part.shape[1] for part in parts)
    return torch.cat([F.pad(part, (0, width - part.shape[1])) for part in parts])


@dataclass
class PassInput:
    """This rank's share of one pass (all of it when ``shard.world_size`` is 1)."""

    embeds: torch.Tensor  # [num_local, hidden], or embedding_row_width with DeepStack rows
    positions: torch.Tensor  # [3, num_local] int64
    batch: AttentionBatch  # the local runs as EXTEND requests (unsharded: one per segment)
    gathered_slots: torch.Tensor  # [num_tokens] int64: pool slot of each gathered row, rank-major
    sizes: list[int]  # tokens of each rank
    logits_rows: list[int]  # local rows whose logits this rank samples
    logits_requests: list[int]  # plan request index of each
    # local rows of the prompt positions whose next token's logprob a request asked for
    prompt_rows: list[int]
    prompt_owners: list[tuple[int, int]]  # (plan request index, prompt position) of each


def _local_part(
    runner: ModelRunner,
    request: RankRequest,
    req_rows: RequestRows,
    seg: PassSegment,
    mine: list[int],
) -> tuple[torch.Tensor, torch.Tensor, tuple[list[int], list[int], list[list[int]]]]:
    """This rank's tokens of ``seg`` (``mine``: offsets into it): their embeddings, positions,
    and attention runs (seq lens, extend lens, page tables)."""
    chunk = merged_embeds(runner, request, req_rows, seg.start, seg.end)
    seg_positions = req_rows.positions[:, seg.start : seg.end]
    pages = runner.page_table.pages(request.request_id)
    if len(mine) == seg.end - seg.start:  # the whole segment: one run
        return chunk, seg_positions, ([seg.end], [len(mine)], [pages])
    index = torch.tensor(mine, dtype=torch.long)
    runs = local_runs([seg.start + i for i in mine], pages, runner.page_size)
    return chunk[index.to(chunk.device)], seg_positions[:, index], runs


def _sharded_slots(
    shard: CpShard, packed_slots: torch.Tensor, local: list[int], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV slots of this rank's tokens, and of every rank's in all-gather order."""
    if shard.world_size == 1:  # every token is this rank's: no index juggling
        return packed_slots, packed_slots
    order = [i for r in range(shard.world_size) for i in shard.local_indices(num_tokens, r)]
    local_slots = (
        packed_slots[torch.tensor(local, dtype=torch.long)]
        if local
        else torch.zeros(0, dtype=torch.long)
    )
    return local_slots, packed_slots[torch.tensor(order, dtype=torch.long)]


def _prompt_positions(
    request: RankRequest, seg: PassSegment, mine: list[int], first_row: int, offset: int
) -> list[tuple[int, int]]:
    """(local row, prompt position) of this rank's tokens of ``seg`` whose logits give the next
    prompt token's logprob (every position but the prompt's last)."""
    positions = [seg.start + i - offset for i in mine]
    last = request.num_tokens - 1
    return [(first_row + k, p) for k, p in enumerate(positions) if p < last]


def build_pass(
    runner: ModelRunner,
    shard: CpShard,
    requests: Sequence[RankRequest],
    rows: Sequence[RequestRows],
    segments: Sequence[PassSegment],
) -> PassInput:
    table = runner.page_table
    num_tokens = sum(s.end - s.start for s in segments)
    local = shard.local_indices(num_tokens)  # ascending packed indices
    slots, embeds, positions = [], [], []
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    page_tables: list[list[int]] = []
    logits_rows: list[int] = []
    logits_requests: list[int] = []
    prompt_rows: list[int] = []
    prompt_owners: list[tuple[int, int]] = []
    offset = 0
    for seg in segments:
        request, req_rows = requests[seg.request], rows[seg.request]
        length = seg.end - seg.start
        lo = bisect.bisect_left(local, offset)  # this segment's local tokens: local[lo:hi]
        hi = bisect.bisect_left(local, offset + length)
        slots.append(table.slots(request.request_id, seg.start, seg.end))
        if hi > lo:
            mine = [i - offset for i in local[lo:hi]]
            seg_embeds, seg_positions, runs = _local_part(runner, request, req_rows, seg, mine)
            embeds.append(seg_embeds)
            positions.append(seg_positions)
            seq_lens += runs[0]
            extend_lens += runs[1]
            page_tables += runs[2]
        if request.params.num_prompt_logprobs >= 0:
            for row, position in _prompt_positions(request, seg, local[lo:hi], lo, offset):
                prompt_rows.append(row)
                prompt_owners.append((seg.request, position))
        last = offset + length - 1
        if seg.end == request.num_tokens and hi > lo and local[hi - 1] == last:
            logits_rows.append(hi - 1)  # its row among this rank's tokens
            logits_requests.append(seg.request)
        offset += length
    local_slots, gathered_slots = _sharded_slots(shard, torch.cat(slots), local, num_tokens)
    hidden = runner.model.config.text.hidden_size
    batch = AttentionBatch(
        ForwardMode.EXTEND, seq_lens, extend_lens, page_tables, runner.page_size, local_slots
    )
    return PassInput(
        widened_cat(embeds)
        if embeds
        else torch.zeros(0, hidden, dtype=runner.dtype, device=runner.device),
        torch.cat(positions, dim=1) if positions else torch.zeros(3, 0, dtype=torch.long),
        batch,
        gathered_slots,
        shard.sizes(num_tokens),
        logits_rows,
        logits_requests,
        prompt_rows,
        prompt_owners,
    )
