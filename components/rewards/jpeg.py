"""JPEG (in)compressibility (docs/ALGORITHM.md section 8): the encoded size at quality 95."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from components.rewards.base import PointwiseReward

JPEG_QUALITY = 95


def jpeg_size_kb(image: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return buffer.tell() / 1000


class JpegCompressibility(PointwiseReward):
    """``-(size_kB) / 500``: smaller files (simpler images) score higher."""

    name = "jpeg_compressibility"

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return -jpeg_size_kb(image) / 500


class JpegIncompressibility(PointwiseReward):
    """The size in kB: more detailed images score higher."""

    name = "jpeg_incompressibility"

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        return jpeg_size_kb(image)
