"""The decode client's domain types and their proto / transfer conversions."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.common.clients.decode import (
    DecodeChunk,
    DecodeRankStats,
    DecodeStats,
    KvRefInfo,
    kv_ref_from_destination,
    kv_ref_from_proto,
    kv_ref_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import common_pb2
from services.common.types import FinishReason, Usage
from services.engine.kv_cache import KVPool
from services.engine.sampler import SamplingParams
from services.transfer.base import pool_layout
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVReceiver


def destination():
    pool = KVPool(3, 10, 4, 2, 8, torch.bfloat16, "cpu")
    receiver = InProcessKVReceiver(InProcessFabric())
    receiver.register(pool)
    return pool, receiver.destination("req-1", [4, 2, 7])


def test_kv_ref_round_trips_through_proto_back_to_the_destination() -> None:
    pool, dest = destination()
    info = kv_ref_from_destination(dest, dp_rank=0)
    assert info.page_ids == (4, 2, 7) and info.dtype == "bfloat16" and info.page_size == 4
    k = info.buffer("k")
    assert k.base_address == pool.k_buffer.data_ptr()
    assert k.size_bytes == pool.k_buffer.numel() * pool.k_buffer.element_size()
    assert k.page_stride_bytes == pool.k_buffer[0, 1].data_ptr() - pool.k_buffer[0, 0].data_ptr()
    assert k.layer_stride_bytes == pool.k_buffer[1].data_ptr() - pool.k_buffer[0].data_ptr()
    assert k.slot_stride_bytes == pool.k_buffer[0, 0, 1].data_ptr() - pool.k_buffer[0, 0, 0].data_ptr()
    wire = kv_ref_to_proto(info).SerializeToString()
    back = kv_ref_from_proto(common_pb2.KvRef.FromString(wire))
    assert back == info
    assert back.to_destination("req-1") == dest
    assert dest.layout == pool_layout(pool)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=KvRefInfo) == info


def test_kv_ref_without_both_buffers_is_invalid() -> None:
    _, dest = destination()
    message = kv_ref_to_proto(kv_ref_from_destination(dest))
    del message.buffers[1]
    with pytest.raises(InvalidRequestError) as caught:
        kv_ref_from_proto(message)
    assert caught.value.param == "kv_ref"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_new_tokens=1),
        SamplingParams(temperature=0.5, top_p=0.25, top_k=7, min_p=0.125, repetition_penalty=1.5,
                       frequency_penalty=-0.5, presence_penalty=2.0, seed=2**64 - 1, max_new_tokens=99,
                       stop_token_ids=(3, 4), ignore_eos=True),
    ],
)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    wire = sampling_params_to_proto(params).SerializeToString()
    assert sampling_params_from_proto(common_pb2.SamplingParams.FromString(wire)) == params


def test_unset_sampling_fields_take_the_engine_defaults() -> None:
    assert sampling_params_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0


def test_chunk_and_stats_round_trip_through_msgpack() -> None:
    chunk = DecodeChunk((1, 2), FinishReason.LENGTH, Usage(3, 3))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(chunk), type=DecodeChunk) == chunk
    rank = DecodeRankStats(0, 8, 5, 2, 1, 0, num_quarantined_pages=1)
    stats = DecodeStats(16, 8, 5, 2, 1, 0, num_quarantined_pages=1, ranks=(rank,))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=DecodeStats) == stats
