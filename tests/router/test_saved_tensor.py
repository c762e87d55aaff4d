"""``prompt_embeds.from_saved`` reads a ``torch.save`` file's header before any element: a normal
tensor round-trips bit for bit, and a file whose shape, strides or storage could make the router
allocate more than the file's own bytes, or whose pickle names anything but a tensor's rebuild, is
refused without torch.load and without inflating a member."""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import time
import zipfile

import pytest
import torch

from services.common.errors import InvalidRequestError
from services.router.prompt_embeds import MAX_HIDDEN_SIZE, from_base64, from_saved, max_file_bytes

CONTEXT = 4096


def saved(tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return buf.getvalue()


class _Storage:
    def __init__(self, numel: int) -> None:
        self.numel = numel


class _Tensor:
    def __init__(self, numel: int, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (_Storage(numel), offset, size, stride)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", torch.FloatStorage, "0", "cpu", obj.numel)
        return None


def crafted(obj, storage: bytes, compression: int = zipfile.ZIP_STORED, order=b"little") -> bytes:
    """A torch.save-like zip whose data.pkl pickles ``obj`` (``_Tensor`` records the header)."""
    pkl = io.BytesIO()
    _Pickler(pkl, protocol=2).dump(obj)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("archive/data.pkl", pkl.getvalue())
        zf.writestr("archive/byteorder", order)
        zf.writestr("archive/data/0", storage, compress_type=compression)
    return buf.getvalue()


def refused(raw: bytes, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        from_saved(raw, CONTEXT)
    assert caught.value.param == "prompt_embeds" and message in str(caught.value), caught.value
    assert time.monotonic() - started < 1.0  # nothing the header claims was built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 48), (1, 7, 48)])
def test_a_dense_tensor_round_trips_bit_for_bit(dtype, shape):
    tensor = torch.randn(shape).to(dtype)
    embeds = from_saved(saved(tensor), CONTEXT)
    assert (embeds.num_tokens, embeds.hidden_size) == (7, 48)
    assert embeds.dtype == str(dtype).removeprefix("torch.")
    got = torch.frombuffer(bytearray(embeds.data), dtype=dtype).reshape(7, 48)
    assert torch.equal(got.view(torch.uint8), tensor.reshape(7, 48).view(torch.uint8))


def test_a_prefix_view_of_a_longer_storage_is_read_from_its_first_bytes():
    rows = torch.randn(10, 8)
    embeds = from_saved(saved(rows[:3]), CONTEXT)
    assert embeds.num_tokens == 3 and embeds.data == rows[:3].numpy().tobytes()


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(1).expand(250_000, 2048), "has 250000 rows (tokens)"),
        (torch.zeros(1).expand(2_500_000, 2048), "has 2500000 rows (tokens)"),
        (torch.zeros(1).expand(4, 10**9), f"the most accepted is {MAX_HIDDEN_SIZE}"),
        (torch.zeros(1).expand(16, 64), "must be contiguous"),  # stride 0
        (torch.randn(64, 16).t(), "must be contiguous"),  # transposed
        (torch.randn(10, 16)[2:], "must be contiguous"),  # storage offset
        (torch.randn(10, 16)[:, :8], "must be contiguous"),  # rows with gaps
        (torch.randn(2, 3, 16), "must be [num_tokens, hidden]"),
        (torch.zeros(3, 16, dtype=torch.float64), "dtype float64 is not one of"),
    ],
)
def test_a_tensor_that_would_allocate_beyond_its_bytes_is_refused(tensor, message):
    refused(saved(tensor), message)


def test_a_storage_shorter_than_the_shape_is_refused():
    refused(crafted(_Tensor(4, 0, (4, 16), (16, 1)), bytes(16)), "has 4 stored values")


def test_a_storage_member_of_another_size_than_declared_is_refused():
    refused(crafted(_Tensor(64, 0, (4, 16), (16, 1)), bytes(8)), "holds 8 bytes, not 256")


def test_a_big_endian_file_is_refused():
    raw = crafted(_Tensor(64, 0, (4, 16), (16, 1)), bytes(256), order=b"big")
    refused(raw, "big-endian")


class _Call:
    def __init__(self, func, *args) -> None:
        self.call = (func, args)

    def __reduce__(self):
        return self.call


def test_a_pickle_that_calls_anything_else_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    raw = crafted(_Call(os.system, f"touch {marker}"), bytes(4))
    refused(raw, "which a saved tensor does not")
    assert not marker.exists()
    refused(crafted(_Call(eval, "1"), bytes(4)), "eval, which")
    refused(crafted(_Call(torch.ones, 10**6), bytes(4)), "which a saved tensor does not")


def test_other_rebuilds_and_containers_are_refused():
    refused(saved(torch.zeros(2, 64).to_sparse()), "not a dense tensor")
    refused(saved(torch.nn.Parameter(torch.zeros(2, 64))), "not a dense tensor")
    refused(saved({"a": torch.zeros(2, 2)}), "holds a dict, not a tensor")
    refused(saved(torch.zeros(2, 2, dtype=torch.float64).to(torch.int32)), "dtype int32")
    refused(b"junk", "not a tensor saved with torch.save")


def test_a_compressed_member_is_refused_without_inflating_it():
    bomb = bytes(32 * 1024 * 1024)  # deflates to ~32 KB
    header = _Tensor(len(bomb) // 4, 0, (512, 16384), (16384, 1))
    raw = crafted(header, bomb, zipfile.ZIP_DEFLATED)
    del bomb
    assert len(raw) < 256 * 1024
    refused(raw, "data/0 is compressed")


def test_a_member_declaring_more_bytes_than_the_file_is_refused():
    raw = bytearray(crafted(_Tensor(64, 0, (4, 16), (16, 1)), bytes(256)))
    entry = raw.index(b"PK\x01\x02")  # the central directory's entries
    while not raw[entry + 46 :].startswith(b"archive/data/0"):
        entry = raw.index(b"PK\x01\x02", entry + 4)
    raw[entry + 20 : entry + 28] = struct.pack("<II", 2**31, 2**31)  # compressed, file size
    refused(bytes(raw), "holds 2147483648 bytes")


def test_base64_longer_than_any_acceptable_file_is_refused_before_decoding():
    context = 8
    text = "A" * ((max_file_bytes(context) // 3 + 2) * 4)
    with pytest.raises(InvalidRequestError) as caught:
        from_base64(text, context)
    assert "larger than" in str(caught.value) and caught.value.param == "prompt_embeds"
