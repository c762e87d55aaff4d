"""One JPEG decoded on several threads, by bands of rows, with PIL's own libjpeg.

A baseline JPEG's entropy-coded data has no index: a row's bits can only be found by
reading every bit before them, so one decoder runs on one core, and the entropy decode is
the larger share of the time (the rest: the IDCT, upsampling and colour conversion of the
rows). ``BandDecoder`` splits the rows into bands, one thread each: the
thread of band k skips the rows above it (``jpeg_skip_scanlines``: entropy decode only) and
decodes its own rows fully, all threads writing into one array. The top bands are the tall
ones (their threads skip little), so every thread ends at about the same time. The pixels
are those of one full decode by the same library,
bit for bit (libjpeg-turbo rebuilds the upsampling context of a band's first row).

The decoder is a small C file (``libjpeg/jpeg_rows.c``, compiled with the host's C compiler
against the libjpeg-turbo headers in ``libjpeg/``) linked to the libjpeg that PIL loads,
so its settings (accurate IDCT, fancy upsampling) and its pixels are PIL's, as the encoder's
other JPEG paths are. ``load_band_decoder`` returns None where that cannot be built (no C
compiler, a PIL without its own libjpeg): the caller then decodes on one thread. Baseline
and extended-sequential Huffman JPEGs only: a progressive or arithmetic-coded file, a
warning, an error or a size that is not the header's is refused (the caller's other
decoders then take the file and give its errors).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import tempfile
from concurrent.futures import Executor
from pathlib import Path

import numpy as np
import PIL
from PIL import Image  # noqa: F401  (loads PIL's libjpeg into the process)

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent / "libjpeg"
_SOURCE = _DIR / "jpeg_rows.c"
_SYMBOL = "stageserve_jpeg_rows"
_MESSAGE_LEN = 256
ROWS_OK = 0  # jpeg_rows.c's status codes
_STATUS = {1: "error", 2: "warning", 3: "mismatch", 4: "unsupported"}
# The entropy decode's share of a full decode, which sets the bands' heights (a typical
# host's; see docs/benchmarks.md). A wrong share makes the threads end at different times,
# never wrong pixels.
ENTROPY_SHARE = 0.6
ROW_ALIGN = 16  # band edges on iMCU rows of 4:2:0 files (16 pixel rows)
MIN_BAND_ROWS = 64  # no band thinner than this: a thread per 16 rows costs more than it saves


def band_bounds(height: int, num_bands: int, entropy_share: float = ENTROPY_SHARE) -> list[int]:
    """Row edges ``[0, ..., height]`` of at most ``num_bands`` bands whose threads end together.

    Thread k skips ``s_k`` rows at cost ``e`` each and decodes ``s_{k+1} - s_k`` at cost 1:
    ``e * s_k + (s_{k+1} - s_k) = T`` for every k gives ``s_{k+1} = s_k * (1 - e) + T``.
    """
    num_bands = max(1, min(num_bands, height // MIN_BAND_ROWS))
    weights = [0.0]
    for _ in range(num_bands):
        weights.append(weights[-1] * (1.0 - entropy_share) + 1.0)
    edges = [0]
    for weight in weights[1:-1]:
        edge = round(height * weight / weights[-1] / ROW_ALIGN) * ROW_ALIGN
        if edge - edges[-1] >= MIN_BAND_ROWS and height - edge >= MIN_BAND_ROWS // 4:
            edges.append(edge)
    edges.append(height)
    return edges


class BandDecoder:
    """``decode(data, width, height)``: the RGB pixels of a JPEG, its bands on ``pool``."""

    def __init__(self, function: ctypes._CFuncPtr, pool: Executor, num_bands: int) -> None:
        self._function = function
        self._pool = pool
        self.num_bands = num_bands

    def decode(self, data: bytes, width: int, height: int) -> np.ndarray | None:
        """[height, width, 3] uint8, or None when this decoder refuses the file (see the
        module docstring; the caller decodes it otherwise)."""
        out = np.empty((height, width, 3), dtype=np.uint8)
        edges = band_bounds(height, self.num_bands)
        bands = list(zip(edges[:-1], edges[1:], strict=True))
        futures = [self._pool.submit(self._rows, data, out, first, last) for first, last in bands]
        refusals = [r for r in (f.result() for f in futures) if r is not None]
        if refusals:
            logger.debug("band decode of a %dx%d JPEG refused: %s", width, height, refusals[0])
            return None
        return out

    def _rows(self, data: bytes, out: np.ndarray, first: int, last: int) -> str | None:
        height, width, _ = out.shape
        message = ctypes.create_string_buffer(_MESSAGE_LEN)
        target = out.ctypes.data + first * width * 3
        status = self._function(
            data, len(data), width, height, first, last, target, message, _MESSAGE_LEN
        )
        if status == ROWS_OK:
            return None
        return f"{_STATUS.get(status, status)}: {message.value.decode(errors='replace')}"


def pil_libjpeg() -> Path | None:
    """The libjpeg shared library PIL bundles (a PyPI wheel's ``pillow.libs``), or None."""
    libs = Path(PIL.__file__).resolve().parent.parent / "pillow.libs"
    found = sorted(libs.glob("libjpeg-*.so*"))
    return found[0] if found else None


def load_band_decoder(pool: Executor, num_bands: int) -> BandDecoder | None:
    """A ``BandDecoder`` over ``pool``, or None (logged) where it cannot be built here. The
    library is built once per process."""
    if num_bands < 2:
        return None
    library = pil_libjpeg()
    compiler = shutil.which("cc")
    if library is None or compiler is None:
        missing = "PIL's own libjpeg" if library is None else "a C compiler (cc)"
        logger.info("JPEGs decode on one thread each: %s is not on this host", missing)
        return None
    function = _compiled(_SOURCE, library, compiler)
    return None if function is None else BandDecoder(function, pool, num_bands)


@functools.cache
def _compiled(source: Path, library: Path, compiler: str) -> ctypes._CFuncPtr | None:
    with tempfile.TemporaryDirectory(prefix="stageserve-jpeg-") as tmp:
        shared = Path(tmp) / "jpeg_rows.so"
        command = [
            compiler, "-O2", "-shared", "-fPIC", "-I", str(_DIR), str(source),
            "-o", str(shared), str(library), f"-Wl,-rpath,{library.parent}",
        ]  # fmt: skip
        try:
            subprocess.run(command, check=True, capture_output=True, timeout=120)
            handle = ctypes.CDLL(str(shared))  # mapped: the file may go with the directory
        except (OSError, subprocess.SubprocessError) as exc:
            stderr = getattr(exc, "stderr", b"") or b""
            logger.warning(
                "JPEGs decode on one thread each: building %s failed: %s %s",
                source.name,
                exc,
                stderr.decode(errors="replace")[-500:],
            )
            return None
    function = getattr(handle, _SYMBOL)
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_char_p,  # data
        ctypes.c_ulong,  # size
        ctypes.c_uint,  # width
        ctypes.c_uint,  # height
        ctypes.c_uint,  # first row
        ctypes.c_uint,  # last row (exclusive)
        ctypes.c_void_p,  # out
        ctypes.c_char_p,  # message
        ctypes.c_ulong,  # message length
    ]
    return function
