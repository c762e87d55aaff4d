"""The decode client's domain types and their proto / transfer conversions."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.common import signing
from services.common.clients.decode import DecodeChunk, DecodeRankStats, DecodeStats
from services.common.destinations import KvDestination
from services.common.errors import InvalidRequestError
from services.common.kv_ref import (
    KvBufferInfo,
    KvRefInfo,
    KvShardInfo,
    issue_kv_ref,
    kv_ref_from_proto,
    kv_ref_to_proto,
)
from services.common.pb.stageserve.v1 import common_pb2
from services.common.types import FinishReason, SamplingParams, Usage
from services.common.wire import sampling_params_from_proto, sampling_params_to_proto
from services.engine.kv_cache import KVPool
from services.transfer.base import pool_layout
from services.transfer.inprocess_backend import InProcessFabric, InProcessKVReceiver


def destination():
    pool = KVPool(3, 10, 4, 2, 8, torch.bfloat16, "cpu")
    receiver = InProcessKVReceiver(InProcessFabric())
    receiver.register(pool)
    return pool, receiver.destination("req-1", [4, 2, 7])


KEY = signing.key_of("client-types-token")
NONCE = bytes(range(16))


def issued(dest) -> KvRefInfo:
    return issue_kv_ref(dest, KEY, NONCE, expires_unix_ms=1_700_000_000_000)


def test_kv_ref_round_trips_through_proto_back_to_the_destination() -> None:
    pool, dest = destination()
    info = issued(dest)
    assert (
        info.request_id == "req-1"
        and info.session_id == dest.session_id
        and info.has_valid_mac(KEY)
    )
    assert info.page_ids == (4, 2, 7) and info.dtype == "bfloat16" and info.page_size == 4
    k = info.buffer("k")
    assert k.base_address == pool.k_buffer.data_ptr()
    assert k.size_bytes == pool.k_buffer.numel() * pool.k_buffer.element_size()
    assert k.page_stride_bytes == pool.k_buffer[0, 1].data_ptr() - pool.k_buffer[0, 0].data_ptr()
    assert k.layer_stride_bytes == pool.k_buffer[1].data_ptr() - pool.k_buffer[0].data_ptr()
    assert (
        k.slot_stride_bytes == pool.k_buffer[0, 0, 1].data_ptr() - pool.k_buffer[0, 0, 0].data_ptr()
    )
    wire = kv_ref_to_proto(info).SerializeToString()
    back = kv_ref_from_proto(common_pb2.KvRef.FromString(wire))
    assert back == info and back.has_valid_mac(KEY)
    assert back.to_destination() == dest
    assert dest.layout == pool_layout(pool)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=KvRefInfo) == info


def _changed(value: object) -> object:
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bytes):
        return value + b"x"
    if isinstance(value, tuple) and value and isinstance(value[0], KvBufferInfo):
        return (
            msgspec.structs.replace(value[0], base_address=value[0].base_address + 4096),
            *value[1:],
        )
    if value == ():  # no tp_shards: one forged in
        return (KvShardInfo("forged", (), 1),)
    assert isinstance(value, tuple)
    return (*value[:-1], value[-1] + 1)


def test_a_tensor_parallel_ref_names_every_pool_and_signs_them() -> None:
    pools = [KVPool(2, 64, 4, 1, 8, torch.float32, "cpu", head_start=h) for h in (0, 1)]
    dests = [
        KvDestination("inprocess", f"session-{h}", "req-1", pool_layout(p), (3, 5, 8))
        for h, p in enumerate(pools)
    ]
    info = issue_kv_ref(dests[0], KEY, NONCE, expires_unix_ms=1, tp_destinations=(dests[1],))
    back = kv_ref_from_proto(common_pb2.KvRef.FromString(kv_ref_to_proto(info).SerializeToString()))
    assert back == info and back.has_valid_mac(KEY)
    assert back.to_destinations() == tuple(dests)
    assert [d.layout.head_start for d in back.to_destinations()] == [0, 1]
    shard = info.tp_shards[0]
    for forged_shard in (
        msgspec.structs.replace(shard, session_id="elsewhere"),
        msgspec.structs.replace(shard, head_start=0),
    ):
        forged = msgspec.structs.replace(info, tp_shards=(forged_shard,))
        assert not forged.has_valid_mac(KEY)
    moved = msgspec.structs.replace(dests[1], page_ids=(3, 5, 9))
    with pytest.raises(ValueError, match="TP ranks' destinations disagree"):
        issue_kv_ref(dests[0], KEY, NONCE, expires_unix_ms=1, tp_destinations=(moved,))


def test_the_mac_covers_every_field_and_the_key() -> None:
    _, dest = destination()
    info = issued(dest)
    names = [n for n in KvRefInfo.__struct_fields__ if n != "mac"]
    assert len(info.signed_fields()) == len(names)
    for name in names:
        forged = msgspec.structs.replace(info, **{name: _changed(getattr(info, name))})
        assert forged != info and not forged.has_valid_mac(KEY), name
    assert not info.has_valid_mac(signing.key_of("another-token"))
    assert not info.has_valid_mac(b"")
    insecure = issue_kv_ref(
        dest, b"", NONCE, expires_unix_ms=1
    )  # empty secret: the explicit insecure mode
    assert insecure.has_valid_mac(b"") and not insecure.has_valid_mac(KEY)


def test_kv_ref_without_both_buffers_is_invalid() -> None:
    _, dest = destination()
    message = kv_ref_to_proto(issued(dest))
    del message.buffers[1]
    with pytest.raises(InvalidRequestError) as caught:
        kv_ref_from_proto(message)
    assert caught.value.param == "kv_ref"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_new_tokens=1),
        SamplingParams(
            temperature=0.5,
            top_p=0.25,
            top_k=7,
            min_p=0.125,
            repetition_penalty=1.5,
            frequency_penalty=-0.5,
            presence_penalty=2.0,
            seed=2**64 - 1,
            max_new_tokens=99,
            stop_token_ids=(3, 4),
            ignore_eos=True,
        ),
        SamplingParams(min_tokens=3, logit_bias=((2, -100.0), (17, 0.5))),
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
    rank = DecodeRankStats(0, 8, 5, 2, 1, 0, num_quarantined_pages=1, is_serving=True)
    stats = DecodeStats(16, 8, 5, 2, 1, 0, num_quarantined_pages=1, ranks=(rank,))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=DecodeStats) == stats


def test_the_kv_ref_conversions_name_every_field():
    """A field added to KvRefInfo or KvBufferInfo must also cross the wire."""
    from services.common import kv_ref as wire

    ref_fields = {*wire._KV_REF_FIELDS, "page_ids", "buffers", "tp_shards"}
    assert set(KvRefInfo.__struct_fields__) == ref_fields
    assert set(KvBufferInfo.__struct_fields__) == {*wire._KV_BUFFER_FIELDS, "kind"}
