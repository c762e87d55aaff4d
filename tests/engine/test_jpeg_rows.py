"""``jpeg_rows``: one JPEG decoded by bands of rows on several threads gives PIL's pixels, bit
for bit; what it refuses; how the bands are cut; where it is not built."""

from __future__ import annotations

import io
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from services.engine.processing import jpeg_rows
from services.engine.processing.jpeg_rows import band_bounds, load_band_decoder

BUILDABLE = shutil.which("cc") is not None and jpeg_rows.pil_libjpeg() is not None
needs_build = pytest.mark.skipif(not BUILDABLE, reason="no C compiler, or no PIL libjpeg")


class CountingPool(ThreadPoolExecutor):
    def __init__(self, num_threads: int) -> None:
        super().__init__(num_threads)
        self.num_submitted = 0

    def submit(self, *args, **kwargs):
        self.num_submitted += 1
        return super().submit(*args, **kwargs)


@pytest.fixture(scope="module")
def pool():
    with CountingPool(6) as pool:
        yield pool


@pytest.fixture(scope="module")
def decoders(pool):
    """Band decoders of 2, 3, 4 and 6 bands on one pool."""
    if not BUILDABLE:
        pytest.skip("no C compiler, or a PIL without its own libjpeg")
    out = {n: load_band_decoder(pool, n) for n in (2, 3, 4, 6)}
    assert all(d is not None for d in out.values()), "cc and PIL's libjpeg are here"
    return out


def jpeg(array: np.ndarray, **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def pil_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_band_bounds_cover_the_rows_with_tall_bands_first():
    for height in (1, 15, 63, 64, 100, 129, 480, 1080, 1081, 4000):
        for num_bands in (1, 2, 3, 4, 8):
            edges = band_bounds(height, num_bands)
            assert edges[0] == 0 and edges[-1] == height
            assert 1 <= len(edges) - 1 <= num_bands
            sizes = [b - a for a, b in zip(edges, edges[1:], strict=False)]
            assert all(s > 0 for s in sizes)
            assert all(e % jpeg_rows.ROW_ALIGN == 0 for e in edges[1:-1])
            assert all(s >= jpeg_rows.MIN_BAND_ROWS for s in sizes[:-1])
            assert sizes == sorted(sizes, reverse=True) or len(sizes) == 1
    assert band_bounds(1080, 4) == [0, 672, 928, 1040, 1080]
    assert band_bounds(1080, 4, entropy_share=0.0) == [0, 272, 544, 816, 1080]  # equal bands


@needs_build
@pytest.mark.parametrize("seed", range(12))
def test_bands_give_the_pixels_of_one_full_decode(decoders, seed):
    """Noise and smooth images of many sizes, every chroma subsampling, restart markers,
    optimized Huffman tables and qualities: every band count equals PIL's decode exactly."""
    rng = np.random.default_rng(seed)
    width, height = int(rng.integers(1, 700)), int(rng.integers(1, 900))
    if seed % 2:
        array = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        y, x = np.mgrid[:height, :width]
        array = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x + y) % 256], -1)
        array = array.astype(np.uint8)
    options = {"quality": int(rng.integers(20, 101)), "subsampling": seed % 3}
    if seed % 4 == 1:
        options["restart_marker_rows"] = 1
    if seed % 4 == 2:
        options["optimize"] = True
    data = jpeg(array, **options)
    expected = pil_pixels(data)
    for num_bands, decoder in decoders.items():
        pixels = decoder.decode(data, width, height)
        assert pixels is not None, (num_bands, options)
        assert np.array_equal(pixels, expected), (num_bands, width, height, options)


@needs_build
def test_each_band_runs_on_the_pool(decoders, pool):
    data = jpeg(np.random.default_rng(1).integers(0, 256, (1080, 320, 3), dtype=np.uint8))
    before = pool.num_submitted
    assert decoders[4].decode(data, 320, 1080) is not None
    assert pool.num_submitted - before == len(band_bounds(1080, 4)) - 1 == 4


@needs_build
def test_refused_files_come_back_as_none(decoders, caplog):
    array = np.random.default_rng(2).integers(0, 256, (300, 200, 3), dtype=np.uint8)
    good = jpeg(array, quality=90)
    decoder = decoders[3]
    caplog.set_level(logging.DEBUG, logger=jpeg_rows.__name__)
    cases = {
        "progressive": (jpeg(array, progressive=True), 200, 300),
        "cut short": (good[: len(good) // 2], 200, 300),
        "not a jpeg": (b"\xff\xd8\xff not a jpeg at all", 200, 300),
        "another size": (good, 201, 300),
    }
    for name, (data, width, height) in cases.items():
        assert decoder.decode(data, width, height) is None, name
    assert "unsupported" in caplog.text and "mismatch" in caplog.text
    assert decoder.decode(good, 200, 300) is not None  # the decoder is unharmed


def test_not_built_without_a_compiler_or_with_one_band(monkeypatch, caplog):
    with ThreadPoolExecutor(2) as pool:
        assert load_band_decoder(pool, 1) is None
        monkeypatch.setattr(jpeg_rows.shutil, "which", lambda name: None)
        caplog.set_level(logging.INFO, logger=jpeg_rows.__name__)
        assert load_band_decoder(pool, 4) is None
    assert "a C compiler (cc) is not on this host" in caplog.text


@needs_build
def test_a_failed_build_is_logged_and_leaves_one_thread(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "jpeg_rows.c"
    broken.write_text("int stageserve_jpeg_rows(void) { return not C; }\n")
    monkeypatch.setattr(jpeg_rows, "_SOURCE", broken)
    with ThreadPoolExecutor(2) as pool, caplog.at_level(logging.WARNING):
        assert load_band_decoder(pool, 2) is None
    assert "building jpeg_rows.c failed" in caplog.text and "error" in caplog.text
