"""What a shapes scene an image shows: the coloured objects in it and their shapes, read by rules built to survive the
soft edges, washed-out colours and pixel noise of a small diffusion model's images:
- colour: a pixel takes the nearest of the palette colours and white, unless it lies far from the line
  white -> that colour (a mixture of two colours, e.g. orange between red and yellow, is none of them);
- objects: connected regions of one colour; regions under ``min_area_fraction`` of the image are specks;
- shape: the region's outline is its coverage (how far each pixel is from white towards the colour, relative
  to the region's core) upsampled and cut at one half -- the level that stays on a blurred edge and is smooth
  where whole pixels are jagged. The ideal square, circle and apex-up triangle of that area placed at its
  centroid are overlaid on it (not fitted to the bounding box, which a faded apex or a stray pixel moves);
  the best overlap (IoU) names the shape, "unknown" below ``MIN_SHAPE_IOU`` (a blob: an extra object).

The ``geneval_shapes`` and ``shapes_edit`` rewards score what it finds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from components.shapes.scenes import BACKGROUND, COLOURS, SHAPES

_WHITE = np.array(BACKGROUND, dtype=np.float64)
_TOWARDS = np.array(list(COLOURS.values()), dtype=np.float64) - _WHITE  # white -> each colour
_CANDIDATES = np.vstack([np.zeros(3), _TOWARDS])  # white and the colours, relative to white
# RGB distance from the line white -> colour beyond which a pixel is a mixture, not a tint of the colour:
# well above pixel noise (std 8 per channel gives ~11), below the ~60 of a half red, half yellow orange.
MAX_OFF_LINE = 45.0
# Ideal shapes of one area overlap each other by up to ~0.85 (a circle on a square); drawn shapes score
# 0.84-0.99 with their own even blurred at 32 px; a region that matches nothing better than this is a blob.
MIN_SHAPE_IOU = 0.75
UPSAMPLE = 4  # sub-pixel grid of the outline and of the ideal shapes
RIM = 2  # pixels around a region whose partial coverage belongs to its soft edge


@dataclass(frozen=True)
class DetectedObject:
    colour: str
    shape: str
    area: int  # pixels of the region
    bbox: tuple[int, int, int, int]  # top, left, bottom, right (exclusive)


def _colour_map(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pixel: its colour's index in ``COLOURS`` plus one (0: white, -1: no colour), and how far it is from
    white towards each colour (H x W x colours; 1 at the palette colour)."""
    offset = image.astype(np.float64) - _WHITE
    nearest = np.linalg.norm(offset[:, :, None, :] - _CANDIDATES, axis=-1).argmin(-1)
    cover = offset @ _TOWARDS.T / (_TOWARDS**2).sum(1)
    colour = np.maximum(nearest - 1, 0)  # white pixels take colour 0 here; their off-line distance is unused
    along = np.take_along_axis(cover, colour[..., None], -1)
    off_line = np.linalg.norm(offset - along * _TOWARDS[colour], axis=-1)
    labels = np.where((nearest > 0) & (off_line > MAX_OFF_LINE), -1, nearest)
    return labels, np.clip(cover, 0.0, 1.0)


def _ideal(shape: str, area: float, cy: float, cx: float, y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Whether points (y, x) lie in the ideal ``shape`` of ``area`` whose centroid is (cy, cx); width = height."""
    if shape == "square":
        half = np.sqrt(area) / 2
        return (np.abs(y - cy) <= half) & (np.abs(x - cx) <= half)
    if shape == "circle":
        return (y - cy) ** 2 + (x - cx) ** 2 <= area / np.pi
    side = np.sqrt(2 * area)  # apex up, base = height; the centroid is 2/3 of the height below the apex
    depth = y - (cy - 2 * side / 3)
    return (depth >= 0) & (depth <= side) & (np.abs(x - cx) <= depth / 2)


def classify_shape(coverage: np.ndarray) -> str:
    """The ideal shape that best overlaps the outline of ``coverage`` (one region's, 0 outside it), or unknown."""
    core = np.percentile(coverage[coverage > 0], 90)  # the region's full colour, below 1 when washed out
    fine = ndimage.zoom(coverage, UPSAMPLE, order=1, grid_mode=True, mode="grid-constant")
    outline = fine >= core / 2
    area = outline.sum()
    if area == 0:
        return "unknown"
    y, x = np.indices(outline.shape, dtype=np.float64)
    cy, cx = y[outline].mean(), x[outline].mean()
    best, best_iou = "unknown", MIN_SHAPE_IOU
    for shape in SHAPES:
        ideal = _ideal(shape, area, cy, cx, y, x)
        common = (ideal & outline).sum()
        iou = common / (area + ideal.sum() - common)
        if iou >= best_iou:
            best, best_iou = shape, iou
    return best


def detect_objects(image: np.ndarray, min_area_fraction: float = 0.01) -> list[DetectedObject]:
    """The coloured objects in an RGB uint8 image; regions under ``min_area_fraction`` of it are specks."""
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"expected an RGB image (H, W, 3), got shape {image.shape}")
    labels, cover = _colour_map(image)
    min_area = max(2, int(np.ceil(min_area_fraction * labels.size)))
    height, width = labels.shape
    found = []
    for index, colour in enumerate(COLOURS, start=1):
        regions, _ = ndimage.label(labels == index)
        for region, (rows, cols) in enumerate(ndimage.find_objects(regions), start=1):
            area = int((regions[rows, cols] == region).sum())
            if area < min_area:
                continue
            top, left = max(rows.start - RIM, 0), max(cols.start - RIM, 0)
            window = np.s_[top:min(rows.stop + RIM, height), left:min(cols.stop + RIM, width)]
            mine = regions[window] == region
            # the soft edge may take white pixels and mixtures, never another region's pixels
            rim = ndimage.binary_dilation(mine, iterations=RIM) & (labels[window] <= 0)
            coverage = np.where(mine | rim, cover[window][..., index - 1], 0.0)
            # room for ideal shapes that reach past the region's box (e.g. the apex a blur faded)
            shape = classify_shape(np.pad(coverage, max(coverage.shape) // 2))
            found.append(DetectedObject(colour, shape, area, (rows.start, cols.start, rows.stop, cols.stop)))
    return found
