"""Input images (editing, image-to-video) as a model takes them: square, at the model's resolution.

A model here makes square images of ``model.resolution`` px, and it edits at that size too: an input image is
cropped to its centre square and resized there (Lanczos, as diffusers' image processor resizes). Two sizes are
refused rather than distorted (docs/DATASETS.md): a side ratio over ``MAX_ASPECT`` (the crop would drop more than
half the picture, and with it what the instruction may name) and a shorter side under ``MIN_SIDE_FRACTION`` of the
resolution (an upscale that far invents the detail the edit should keep).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from components.errors import DataError

MAX_ASPECT = 2.0
MIN_SIDE_FRACTION = 0.25


def size_problem(height: int, width: int, resolution: int) -> str | None:
    """Why an input image of ``height`` x ``width`` cannot be edited at ``resolution`` px, or None."""
    short, long = sorted((height, width))
    if long > MAX_ASPECT * short:
        return (f"{width}x{height} px is more than {MAX_ASPECT:g}:1; crop it nearer to square (the model edits "
                f"{resolution}x{resolution} px, and the centre crop would drop over half of it)")
    if short < MIN_SIDE_FRACTION * resolution:
        return (f"{width}x{height} px is too small for a {resolution} px model (the shorter side must be at least "
                f"{MIN_SIDE_FRACTION * resolution:g} px)")
    return None


def square(image: np.ndarray, resolution: int) -> np.ndarray:
    """uint8 (H, W, 3) -> its centre square resized to (resolution, resolution, 3) uint8."""
    height, width = image.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    crop = Image.fromarray(np.ascontiguousarray(image[top:top + side, left:left + side]))
    if side != resolution:
        crop = crop.resize((resolution, resolution), Image.LANCZOS)
    return np.asarray(crop, dtype=np.uint8)


def model_input(rows: list[list[np.ndarray]], resolution: int, where: list[str] | None = None) -> torch.Tensor:
    """Each row's input images (uint8 (H, W, 3)) as the adapters take them: (B, N, 3, R, R) float32 in [-1, 1].
    A size ``size_problem`` refuses raises a DataError naming the row (``where[i]``, else its index)."""
    counts = {len(images) for images in rows}
    if len(counts) != 1:
        raise DataError(f"rows carry different numbers of input images ({sorted(counts)}); a model takes the same "
                        "number with every prompt")
    out = []
    for i, images in enumerate(rows):
        for image in images:
            problem = size_problem(image.shape[0], image.shape[1], resolution)
            if problem:
                raise DataError(f"{where[i] if where else f'row {i}'}: input image {problem}")
        out.append(np.stack([square(image, resolution) for image in images]))
    pixels = torch.from_numpy(np.stack(out)).permute(0, 1, 4, 2, 3).float()
    return pixels / 127.5 - 1.0
