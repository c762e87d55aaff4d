"""Image side of preprocessing for Qwen2-VL / Qwen2.5-VL: the patch grid and the pixels.

``grid_for_size`` turns an image's size (``image_file.image_size``, from the header) into
its patch grid, hence the number of placeholder tokens. ``preprocess`` resizes (PIL
bicubic), rescales, normalizes and patchifies decoded pixels on the CPU, equal to
``transformers``' ``Qwen2VLImageProcessorPil``; ``preprocess_tensor`` does the same on
decoded uint8 pixels on any torch device (the encoder's GPU path), within a tolerance of it
(PIL's two rounded passes, mirrored). ``pixel_hash`` hashes the preprocessed pixels, for
checks that two byte-different files preprocess the same.

torch is imported by the pixel functions only: the router and the tokenizer compute grids
with this module and never load torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import PIL
from PIL import Image

from services.common.errors import InvalidRequestError, ModelLoadError
from services.engine.processing.image_file import to_rgb

if TYPE_CHECKING:
    import torch

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200
# PIL filters with a torch twin (antialias=True: PIL's support scaling and a = -0.5 cubic).
_TORCH_RESAMPLE = {
    int(Image.Resampling.BILINEAR): "bilinear",
    int(Image.Resampling.BICUBIC): "bicubic",
}
_PIL_ORDERS_BY_SHRINK = int(PIL.__version__.split(".")[0]) >= 13  # Pillow 13 may go vertical first


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 14 * 14 * 4 * 1280,
) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible (Qwen2-VL's rule)."""
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"image has an empty side ({width}x{height})", param="image")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {width}x{height}",
            param="image",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, 3 * temporal * patch * patch] float32
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the 2x2 merge


def pixel_hash(processed: ProcessedImage) -> str:
    """SHA-256 hex of the preprocessed pixels and their grid."""
    digest = hashlib.sha256(repr(processed.grid_thw).encode())
    digest.update(processed.pixel_values.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _first_set(*values: Any) -> Any:
    return next(value for value in values if value is not None)


@dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = int(Image.Resampling.BICUBIC)

    @property
    def factor(self) -> int:
        """Pixel side of one merged token."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ImageProcessorConfig:
        """From a ``preprocessor_config.json``; ``min_pixels``/``max_pixels`` win over ``size``."""
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if config.get(flag, True) is not True:
                raise ModelLoadError(
                    f"preprocessor config sets {flag}={config[flag]!r}; only true is supported"
                )
        default = cls()
        size = config.get("size") or {}
        return cls(
            patch_size=config.get("patch_size", default.patch_size),
            temporal_patch_size=config.get("temporal_patch_size", default.temporal_patch_size),
            merge_size=config.get("merge_size", default.merge_size),
            min_pixels=_first_set(
                config.get("min_pixels"), size.get("shortest_edge"), default.min_pixels
            ),
            max_pixels=_first_set(
                config.get("max_pixels"), size.get("longest_edge"), default.max_pixels
            ),
            image_mean=tuple(config.get("image_mean", default.image_mean)),
            image_std=tuple(config.get("image_std", default.image_std)),
            rescale_factor=config.get("rescale_factor", default.rescale_factor),
            resample=config.get("resample", default.resample),
        )


class ImageProcessor:
    """Size-only grid computation and pixel preprocessing for one checkpoint."""

    def __init__(self, config: ImageProcessorConfig) -> None:
        self.config = config
        self._table = _normalize_table(config)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessor:
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} does not exist")
        return cls(ImageProcessorConfig.from_dict(json.loads(path.read_text(encoding="utf-8"))))

    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """Patch grid (t, h, w) of a still image of this size; no pixel work."""
        cfg = self.config
        resized_height, resized_width = smart_resize(
            height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels
        )
        return 1, resized_height // cfg.patch_size, resized_width // cfg.patch_size

    def grid_for(self, image: Image.Image) -> tuple[int, int, int]:
        return self.grid_for_size(image.height, image.width)

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholder tokens (merged patches) an image of this grid takes in the prompt."""
        grid_t, grid_h, grid_w = grid_thw
        return grid_t * grid_h * grid_w // self.config.merge_size**2

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        """Resize, rescale, normalize and patchify one image, as transformers' PIL backend does."""
        cfg = self.config
        image = to_rgb(image)
        grid_thw = self.grid_for(image)
        _, grid_h, grid_w = grid_thw
        resized = image.resize(
            (grid_w * cfg.patch_size, grid_h * cfg.patch_size), resample=cfg.resample
        )
        import torch

        pixels = torch.from_numpy(np.array(resized, dtype=np.uint8))  # [H, W, 3] uint8
        return ProcessedImage(self._normalize_patchify(pixels.permute(2, 0, 1)[None]), grid_thw)

    def preprocess_tensor(self, pixels: torch.Tensor) -> torch.Tensor:
        """``preprocess`` of N decoded images of one size, on ``pixels``' device.

        ``pixels``: [N, H, W, 3] uint8 (RGB). Returns the N images' patches in order,
        [N * grid_h * grid_w, C * t * p * p] float32, the grid being ``grid_for_size(H, W)``.
        PIL's resize is mirrored: two separable antialiased passes in PIL's order, each
        rounded and clamped to uint8; the rest is the PIL path's arithmetic.
        """
        import torch
        import torch.nn.functional as F

        mode = self.tensor_resample_mode()
        _, height, width, _ = pixels.shape
        _, grid_h, grid_w = self.grid_for_size(height, width)
        size = (grid_h * self.config.patch_size, grid_w * self.config.patch_size)
        x = pixels.permute(0, 3, 1, 2).float()  # [N, 3, H, W] float32, integral values
        for pass_size in _pil_pass_sizes((height, width), size):
            x = F.interpolate(x, size=pass_size, mode=mode, antialias=True, align_corners=False)
            x = (x + 0.5).floor_().clamp_(0, 255)  # PIL's round half up into uint8
        return self._normalize_patchify(x.to(torch.uint8))

    def tensor_resample_mode(self) -> str:
        """The torch interpolate mode of the config's PIL filter; ModelLoadError without one."""
        mode = _TORCH_RESAMPLE.get(self.config.resample)
        if mode is None:
            raise ModelLoadError(
                f"preprocessor resample={self.config.resample} has no torch path (bilinear and "
                "bicubic do); preprocess this checkpoint's pixels with PIL"
            )
        return mode

    def _normalize_patchify(self, pixels: torch.Tensor) -> torch.Tensor:
        # [N, C, H, W] uint8 -> [N * grid_h * grid_w, C * t * p * p] float32 on pixels' device.
        import torch

        table = torch.from_numpy(self._table).to(pixels.device)  # [C, 256] float32
        normalized = torch.stack([table[c][pixels[:, c].long()] for c in range(table.shape[0])], 1)
        return self._patchify(normalized)

    def _patchify(self, normalized: torch.Tensor) -> torch.Tensor:
        # [N, C, H, W] float32 -> [N * grid_h * grid_w, C * t * p * p], image by image.
        # Rows: merge windows row-major; inside a window its patches row-major.
        # Columns: channel, temporal copy, patch row, patch column.
        cfg = self.config
        p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
        num_images, channels, height, width = normalized.shape
        grid_h, grid_w = height // p, width // p
        x = normalized.reshape(num_images, channels, grid_h // m, m, p, grid_w // m, m, p)
        x = x.permute(0, 2, 5, 3, 6, 1, 4, 7)  # [N, gh/m, gw/m, m, m, C, p, p]
        x = x.unsqueeze(6).expand(
            *x.shape[:6], t, p, p
        )  # one frame repeated over the temporal patch
        return x.reshape(num_images * grid_h * grid_w, channels * t * p * p).contiguous()


def _normalize_table(config: ImageProcessorConfig) -> np.ndarray:
    """[C, 256] float32: each uint8 value rescaled (in float64) and normalized, as transformers
    does."""
    values = (np.arange(256, dtype=np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None]
    return (values[None, :] - mean) / std


def _pil_pass_sizes(size: tuple[int, int], target: tuple[int, int]) -> list[tuple[int, int]]:
    """The (height, width) after each of PIL's resample passes; a side that keeps its size
    takes no pass. Horizontal first, unless (Pillow >= 13) the height shrinks by more than
    twice as many pixels as the width."""
    (height, width), (target_h, target_w) = size, target
    shrink_h, shrink_w = height - target_h, width - target_w
    is_vertical_first = _PIL_ORDERS_BY_SHRINK and shrink_h > 0 and shrink_h > 2 * shrink_w
    steps = [(height, target_w), target] if not is_vertical_first else [(target_h, width), target]
    passes, current = [], size
    for step in steps:
        if step != current:
            passes.append(step)
            current = step
    return passes
