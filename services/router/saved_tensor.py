"""One tensor written by ``torch.save``, read without ``torch.load``: its header first, its bytes
only once the caller has checked the header.

The file is a zip of stored (uncompressed) members. ``<archive>/data.pkl`` pickles the call
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
backward_hooks)`` whose ``storage`` is the persistent id ``("storage", torch.<T>Storage, key,
location, numel)``; ``<archive>/data/<key>`` holds the storage's raw little-endian elements.

``read_header`` unpickles ``data.pkl`` (at most ``MAX_PICKLE_BYTES``) with an unpickler that
resolves only those names, to inert records defined here: nothing of torch's is called and any
other global is refused, so no pickled code runs and a header can claim any shape without
anything being allocated for it. ``read_storage`` returns a storage member's bytes after checking
the zip's own sizes: the member must be stored, not compressed, and lie inside the file, so what
it returns is never larger than the file. Every refusal is a ``SavedTensorError``.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass
from typing import Any

MAX_PICKLE_BYTES = 64 * 1024
STORAGE_DTYPES = {  # torch.<name> storage type -> dtype name
    "FloatStorage": "float32",
    "BFloat16Storage": "bfloat16",
    "HalfStorage": "float16",
    "DoubleStorage": "float64",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}
ITEMSIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


class SavedTensorError(ValueError):
    """The bytes are not one tensor as ``torch.save`` writes it (the message says why)."""


@dataclass(frozen=True, slots=True)
class StorageRef:
    dtype: str
    key: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class TensorHeader:
    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def is_row_major(self) -> bool:
        """The elements lie in order from the storage's start (strides of size-1 dims aside)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return self.storage_offset == 0


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str


def _is_int(value: Any) -> bool:
    return type(value) is int


def _rebuild_tensor_v2(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> TensorHeader:
    if not isinstance(storage, StorageRef):
        raise SavedTensorError("the tensor's storage is not a saved storage")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)):
        raise SavedTensorError("the tensor's size and stride are not tuples of one length")
    if not all(_is_int(v) and v >= 0 for v in (storage_offset, *size, *stride)):
        raise SavedTensorError("the tensor's offset, size and stride are not integers >= 0")
    return TensorHeader(storage, storage_offset, size, stride)


def _backward_hooks() -> dict:
    return {}


class _HeaderUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return _backward_hooks
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch._utils" and name.startswith("_rebuild_"):
            raise SavedTensorError(f"it is not a dense tensor (torch._utils.{name})")
        raise SavedTensorError(f"it names {module[:64]}.{name[:64]}, which a saved tensor does not")

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise SavedTensorError("its persistent id is not a storage")
        _, storage_type, key, _location, numel = pid
        if not (isinstance(storage_type, _StorageType) and isinstance(key, str) and _is_int(numel)):
            raise SavedTensorError("its storage record is malformed")
        if numel < 0:
            raise SavedTensorError("its storage has a negative size")
        return StorageRef(storage_type.dtype, key, numel)


class SavedFile:
    """The zip ``torch.save`` wrote: ``header()`` then ``storage_bytes(ref)``."""

    def __init__(self, raw: bytes) -> None:
        self._size = len(raw)
        try:
            self._zip = zipfile.ZipFile(io.BytesIO(raw))
        except (zipfile.BadZipFile, ValueError, EOFError) as exc:
            raise SavedTensorError(f"it is not a torch.save zip file ({exc})") from None
        pickles = [n for n in self._zip.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise SavedTensorError("it has no single <archive>/data.pkl")
        self._prefix = pickles[0].removesuffix("data.pkl")

    def header(self) -> Any:
        """What ``data.pkl`` unpickles to: a ``TensorHeader`` for one tensor (a dict, a list ...
        of them otherwise); ``SavedTensorError`` when it names anything else."""
        order = self._prefix + "byteorder"
        if order in self._zip.namelist() and self._member(order, 16) != b"little":
            raise SavedTensorError("it was saved big-endian")
        data = self._member(self._prefix + "data.pkl", MAX_PICKLE_BYTES)
        try:
            return _HeaderUnpickler(io.BytesIO(data)).load()
        except SavedTensorError:
            raise
        except Exception as exc:  # a malformed pickle raises many types; none is ours
            raise SavedTensorError(
                f"its data.pkl does not unpickle ({type(exc).__name__})"
            ) from None

    def storage_bytes(self, ref: StorageRef) -> bytes:
        """The storage's raw bytes, exactly ``ref.nbytes`` of them."""
        return self._member(f"{self._prefix}data/{ref.key}", ref.nbytes, exact=True)

    def _member(self, name: str, max_bytes: int, exact: bool = False) -> bytes:
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise SavedTensorError(f"it has no member {name[:200]}") from None
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise SavedTensorError(f"its member {name[:200]} is compressed")
        if info.file_size > min(max_bytes, self._size) or (exact and info.file_size != max_bytes):
            raise SavedTensorError(
                f"its member {name[:200]} holds {info.file_size} bytes, "
                f"{'not' if exact else 'more than'} {max_bytes}"
            )
        try:
            return self._zip.read(info)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError) as exc:
            raise SavedTensorError(f"its member {name[:200]} is damaged ({exc})") from None
