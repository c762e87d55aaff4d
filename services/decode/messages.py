"""What the decode leader and one decode rank exchange: commands in, a report per step out.

The leader posts ``RankCommands`` as it gets them; every step of a rank
(``DecodeRankStep.run_step``) takes the commands posted since its previous step, in
arrival order, and reports one ``RankReport`` unasked: a reply per command, the tokens
the step read, the requests that ended, and the rank's load. Errors a command meets
travel as ``ErrorRecord`` and become the same ``StageServeError`` class on the leader.
msgpack on the control channel, never pickle.
"""

from __future__ import annotations

import msgspec

from services.common.destinations import KvDestination
from services.common.errors import ErrorRecord
from services.common.types import FinishReason, SamplingParams, TokenLogprob, Usage
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, NO_QUANTIZATION


class RankInit(msgspec.Struct, frozen=True):
    """How a decode rank builds itself (its device comes from the rank group)."""

    model: str  # checkpoint directory
    dtype: str | None
    num_pages: int | None  # None: sized from gpu_memory_utilization (CUDA)
    gpu_memory_utilization: float  # this rank's share of its GPU
    page_size: int
    max_model_len: int | None  # None: the model's max_position_embeddings
    max_running_requests: int
    attention_backend: str
    kv_backend: str  # the KV receiver the rank creates (shm, cuda_ipc, mooncake, inprocess)
    transfer_host: str  # Mooncake: the hostname its engine advertises
    kv_quarantine_s: float
    gpu_share_file: str = ""  # prefill on this GPU marks its forwards there; empty: none
    prefill_first_s: float = 0.0  # the longest a step waits for a marked prefill forward
    quantization: str = NO_QUANTIZATION  # the decoder's dense linears (engine/quantization.py)
    kv_cache_dtype: str = AUTO_KV_CACHE_DTYPE  # the KV pages (engine/quantization.py)
    tp_size: int = 1  # processes of this tensor-parallel rank (tp_rank.py)
    ep_size: int = 1  # of them, those an MoE layer's experts split over: 1 or tp_size
    # DP attention (dp_attention.py): the group's processes are its DP ranks, their MLP and MoE
    # layers split over the group (ep_size: 1 or the group's size)
    dp_attention: bool = False


# --- leader -> rank ---------------------------------------------------------------
class ReserveCommand(msgspec.Struct, frozen=True, tag="reserve"):
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    rope_delta: int  # M-RoPE position delta of the prompt
    lifetime_s: float  # the reservation expires this long after the rank takes it
    kv_written_proof: bytes  # what prefill returns once the KV landed (signing.kv_written_proof)


class StartCommand(msgspec.Struct, frozen=True, tag="start"):
    request_id: str
    first_token_id: int
    kv_written_proof: bytes


class AbortCommand(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str
    is_kv_written: (
        bool  # prefill finished writing: a reservation's pages are freed, not quarantined
    )


Command = ReserveCommand | StartCommand | AbortCommand


class RankCommands(msgspec.Struct, frozen=True):
    """One post: commands in arrival order, for DP rank ``dp_rank`` of a DP-attention group
    (the group's rank 0 hands them on); 0 otherwise."""

    commands: tuple[Command, ...] = ()
    dp_rank: int = 0


# --- rank -> leader ---------------------------------------------------------------
class ReserveReply(msgspec.Struct, frozen=True, tag="reserve"):
    request_id: str
    destination: KvDestination | None = None  # where prefill writes; None on error
    error: ErrorRecord | None = None
    # a tensor-parallel rank: the same pages in TP ranks 1 .. T-1's pools (destination: 0's)
    tp_destinations: tuple[KvDestination, ...] = ()


class StartReply(msgspec.Struct, frozen=True, tag="start"):
    request_id: str
    error: ErrorRecord | None = None


class AbortReply(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str
    is_found: bool  # it was live (reserved or running) and is now aborted


Reply = ReserveReply | StartReply | AbortReply


class Finished(msgspec.Struct, frozen=True):
    """A request that finished (its last token, if any, is in the report's tokens)."""

    request_id: str
    reason: FinishReason
    usage: Usage


class RankLoad(msgspec.Struct, frozen=True):
    """A rank's pages and requests after its step; free + used + quarantined = total."""

    page_size: int
    max_model_len: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_quarantined_pages: int
    num_running_requests: int  # generating: running or waiting to join
    num_reserved_requests: int  # holding pages, waiting for their KV
    max_running_requests: int  # batch slots: the most requests one step runs


class RankReport(msgspec.Struct, frozen=True):
    """The result of one step: replies in command order (the posts it applied), then what the
    step read."""

    replies: tuple[Reply, ...]
    # Parallel: token_ids[i] is the new token of token_request_ids[i] (one per request per read
    # step)
    token_request_ids: tuple[str, ...]
    token_ids: tuple[int, ...]
    finished: tuple[Finished, ...]  # after their tokens above
    expired: tuple[str, ...]  # reservations that passed their deadline (pages quarantined)
    load: RankLoad
    num_read_rows: int  # rows of the step read here (0: none was read)
    read_step_s: float  # launch to read of that step, seconds
    prefill_wait_s: float = 0.0  # this step's wait for prefill's forwards (not in read_step_s)
    # The logprobs of the tokens whose request asked: logprobs[j] is token_ids[logprob_indices[j]]'s
    logprob_indices: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


class DpReports(msgspec.Struct, frozen=True):
    """The result of one step of a DP-attention group: every DP rank's report, rank order."""

    reports: tuple[RankReport, ...]
