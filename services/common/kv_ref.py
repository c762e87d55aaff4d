"""Proto <-> domain conversions of ``stageserve.v1.KvRef``: ``KvRefInfo`` is its domain form.

Decode issues it signed (``issue_kv_ref``), the router gets it from ``DecodeClient.reserve``
and hands it unchanged to the prefill client (``kv_ref_to_proto``); prefill checks its MAC and
turns it back into the ``KvDestination`` of each of decode's pools
(``KvRefInfo.to_destinations``) to write the KV. Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.common import signing
from services.common.destinations import KvDestination, KvPoolLayout
from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import common_pb2


class KvBufferInfo(msgspec.Struct, frozen=True):
    """One registered K or V buffer of decode's pool, ``[layers, pages, page_size, heads, dim]``."""

    kind: str  # "k" | "v"
    base_address: int
    size_bytes: int
    layer_stride_bytes: int
    page_stride_bytes: int
    slot_stride_bytes: int


class KvShardInfo(msgspec.Struct, frozen=True):
    """One more tensor-parallel decode rank's pool of a ``KvRefInfo`` (the proto ``KvRefShard``)."""

    session_id: str
    buffers: tuple[KvBufferInfo, ...]  # one "k", one "v"
    head_start: int  # the model's first KV head it holds


class KvRefInfo(msgspec.Struct, frozen=True):
    """Where prefill writes one request's prompt KV (mirrors the proto ``KvRef``), signed by decode.

    ``mac`` covers every other field (``signed_fields``), so prefill trusts a KvRef only
    when ``has_valid_mac``: the pages, the layout and the endpoint are the ones decode
    issued for ``request_id``, until ``expires_unix_ms``.
    """

    request_id: str
    backend: str  # transfer backend name as services.transfer knows it ("mooncake", "inprocess")
    session_id: str  # the owning decode rank's transfer-engine endpoint (Mooncake: "host:rpc_port")
    dp_rank: int
    page_ids: tuple[int, ...]  # the prompt's pages, position order
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without prefix
    buffers: tuple[KvBufferInfo, ...]  # one "k", one "v"
    nonce: bytes  # signing.NONCE_BYTES random bytes, one per reservation
    expires_unix_ms: int  # the reservation's deadline, ms since the Unix epoch
    mac: bytes  # signing.sign(key, KV_REF, signed_fields())
    # a tensor-parallel decode rank: TP ranks 1 .. T-1's pools (the fields above: TP rank 0's,
    # from head 0), the same pages in each; (): one pool holds every head
    tp_shards: tuple[KvShardInfo, ...] = ()

    def buffer(self, kind: str) -> KvBufferInfo:
        return _buffer(self.buffers, kind)

    def signed_fields(self) -> tuple[object, ...]:
        """Every field but ``mac``, in declaration order: what the MAC covers."""
        return tuple(getattr(self, name) for name in self.__struct_fields__ if name != "mac")

    def has_valid_mac(self, key: bytes) -> bool:
        return signing.verify(key, signing.KV_REF, self.signed_fields(), self.mac)

    def to_destination(self) -> KvDestination:
        """The destination prefill's KV sender writes to (TP rank 0's pool of a decode rank)."""
        return self._destination(self.session_id, self.buffers, 0)

    def to_destinations(self) -> tuple[KvDestination, ...]:
        """Every pool of the decode rank, TP rank order (one without tensor parallelism)."""
        return (
            self.to_destination(),
            *(self._destination(s.session_id, s.buffers, s.head_start) for s in self.tp_shards),
        )

    def _destination(
        self, session_id: str, buffers: tuple[KvBufferInfo, ...], head_start: int
    ) -> KvDestination:
        k, v = _buffer(buffers, "k"), _buffer(buffers, "v")
        layout = KvPoolLayout(
            k_base=k.base_address,
            v_base=v.base_address,
            num_layers=self.num_layers,
            num_pages=k.layer_stride_bytes // k.page_stride_bytes,
            page_size=self.page_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_nbytes=k.page_stride_bytes,
            head_start=head_start,
        )
        return KvDestination(self.backend, session_id, self.request_id, layout, self.page_ids)


def _buffer(buffers: tuple[KvBufferInfo, ...], kind: str) -> KvBufferInfo:
    return next(b for b in buffers if b.kind == kind)


def _buffers(layout: KvPoolLayout) -> tuple[KvBufferInfo, ...]:
    layer_stride = layout.num_pages * layout.page_nbytes
    return tuple(
        KvBufferInfo(
            kind=kind,
            base_address=base,
            size_bytes=layout.num_layers * layer_stride,
            layer_stride_bytes=layer_stride,
            page_stride_bytes=layout.page_nbytes,
            slot_stride_bytes=layout.page_nbytes // layout.page_size,
        )
        for kind, base in (("k", layout.k_base), ("v", layout.v_base))
    )


def issue_kv_ref(
    destination: KvDestination,
    key: bytes,
    nonce: bytes,
    expires_unix_ms: int,
    dp_rank: int = 0,
    tp_destinations: tuple[KvDestination, ...] = (),
) -> KvRefInfo:
    """Decode's signed KvRef of ``destination`` (a reservation of ``destination.request_id``;
    ``tp_destinations``: the same pages in the pools of TP ranks 1 .. T-1 of a tensor-parallel
    decode rank, whose TP rank 0 holds ``destination``)."""
    layout = destination.layout
    for other in tp_destinations:
        if other.page_ids != destination.page_ids or other.request_id != destination.request_id:
            raise ValueError(f"{destination.request_id}: TP ranks' destinations disagree")
    unsigned = KvRefInfo(
        request_id=destination.request_id,
        backend=destination.backend,
        session_id=destination.session_id,
        dp_rank=dp_rank,
        page_ids=tuple(destination.page_ids),
        page_size=layout.page_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        buffers=_buffers(layout),
        nonce=nonce,
        expires_unix_ms=expires_unix_ms,
        mac=b"",
        tp_shards=tuple(
            KvShardInfo(d.session_id, _buffers(d.layout), d.layout.head_start)
            for d in tp_destinations
        ),
    )
    mac = signing.sign(key, signing.KV_REF, unsigned.signed_fields())
    return msgspec.structs.replace(unsigned, mac=mac)


_BUFFER_KINDS = {"k": common_pb2.KV_BUFFER_KIND_K, "v": common_pb2.KV_BUFFER_KIND_V}
_BUFFER_KIND_NAMES = {code: name for name, code in _BUFFER_KINDS.items()}


# Fields copied as they are between KvRefInfo / KvBufferInfo and their protos.
_KV_REF_FIELDS = (
    "request_id",
    "backend",
    "session_id",
    "dp_rank",
    "page_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "dtype",
    "nonce",
    "expires_unix_ms",
    "mac",
)
_KV_BUFFER_FIELDS = (
    "base_address",
    "size_bytes",
    "layer_stride_bytes",
    "page_stride_bytes",
    "slot_stride_bytes",
)


def _buffers_to_proto(buffers: tuple[KvBufferInfo, ...]) -> list[common_pb2.KvBuffer]:
    return [
        common_pb2.KvBuffer(
            kind=_BUFFER_KINDS[b.kind], **{f: getattr(b, f) for f in _KV_BUFFER_FIELDS}
        )
        for b in buffers
    ]


def _buffers_from_proto(buffers: Sequence[common_pb2.KvBuffer]) -> tuple[KvBufferInfo, ...]:
    """``InvalidRequestError`` unless ``buffers`` are exactly one K and one V buffer."""
    kinds = sorted(_BUFFER_KIND_NAMES.get(b.kind, "?") for b in buffers)
    if kinds != ["k", "v"] or any(b.page_stride_bytes == 0 for b in buffers):
        raise InvalidRequestError(
            "kv_ref must carry one K and one V buffer and a page size", param="kv_ref"
        )
    return tuple(
        KvBufferInfo(
            kind=_BUFFER_KIND_NAMES[b.kind], **{f: getattr(b, f) for f in _KV_BUFFER_FIELDS}
        )
        for b in buffers
    )


def kv_ref_to_proto(info: KvRefInfo) -> common_pb2.KvRef:
    return common_pb2.KvRef(
        page_ids=info.page_ids,
        buffers=_buffers_to_proto(info.buffers),
        tp_shards=[
            common_pb2.KvRefShard(
                session_id=s.session_id,
                buffers=_buffers_to_proto(s.buffers),
                head_start=s.head_start,
            )
            for s in info.tp_shards
        ],
        **{f: getattr(info, f) for f in _KV_REF_FIELDS},
    )


def kv_ref_from_proto(message: common_pb2.KvRef) -> KvRefInfo:
    """``InvalidRequestError`` unless the message and each TP shard name exactly one K and one
    V buffer."""
    if message.page_size == 0:
        raise InvalidRequestError(
            "kv_ref must carry one K and one V buffer and a page size", param="kv_ref"
        )
    return KvRefInfo(
        page_ids=tuple(message.page_ids),
        buffers=_buffers_from_proto(message.buffers),
        tp_shards=tuple(
            KvShardInfo(s.session_id, _buffers_from_proto(s.buffers), s.head_start)
            for s in message.tp_shards
        ),
        **{f: getattr(message, f) for f in _KV_REF_FIELDS},
    )
