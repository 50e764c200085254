"""A row's input images (editing, image-to-video): where they are, read and checked as hostile input, and made
the size the model takes.

A reference is a local path, an ``s3://`` URI or a ``data:image/...;base64,`` URL (the built-in sets inline
theirs). Every image passes the reward server's rules before a pixel is decoded: PNG or JPEG, at most
``MAX_PIXELS`` pixels read from the header (a decompression bomb costs nothing), a file that decodes whole.

A model here makes square images of ``model.resolution`` px, and it edits at that size too: an input image is
cropped to its centre square and resized there (Lanczos, as diffusers' image processor resizes). Two sizes are
refused rather than distorted (docs/DATASETS.md): a side ratio over ``MAX_ASPECT`` (the crop would drop more than
half the picture, and with it what the instruction may name) and a shorter side under ``MIN_SIDE_FRACTION`` of the
resolution (an upscale that far invents the detail the edit should keep).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from functools import lru_cache
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from components import storage
from components.dataset.prepared import PromptRow
from components.errors import DataError
from components.rewards.codec import ImageDecodeError, ImageTooLargeError, decode_image, image_bytes_b64

if TYPE_CHECKING:
    import torch

MAX_PIXELS = 4096 * 4096  # the reward server's default per image
DATA_URL = "data:"
MAX_ASPECT = 2.0
MIN_SIDE_FRACTION = 0.25


class InputImageError(DataError):
    """An input image that is missing, unreadable or too large; ``reason`` is a `prepare-dataset` reason key."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve(ref: str, base: str | None) -> str:
    """A reference as given in a row of the file ``base`` (relative paths are relative to its folder)."""
    if ref.startswith(DATA_URL) or storage.is_uri(ref) or PurePosixPath(ref).is_absolute() or base is None:
        return ref
    if storage.is_uri(base):  # a path's parent would fold the scheme's "//"
        return storage.join(base.rsplit("/", 1)[0], ref)
    return str(PurePosixPath(base).parent / ref)


def _describe(ref: str) -> str:
    return "an inline data: URL" if ref.startswith(DATA_URL) else ref


def read_bytes(ref: str) -> bytes:
    """The file bytes of one reference; InputImageError (reason ``image_missing``) when there are none."""
    if ref.startswith(DATA_URL):
        try:
            return image_bytes_b64(ref)
        except ImageDecodeError as exc:
            raise InputImageError(f"input image {_describe(ref)}: {exc}", "image_unreadable") from exc
    try:
        if not storage.exists(ref):
            raise InputImageError(f"input image {ref} does not exist", "image_missing")
        return storage.get_bytes(ref)
    except storage.StorageError as exc:
        raise InputImageError(f"input image {ref}: {exc}", "image_missing") from exc


def decode(raw: bytes, ref: str) -> np.ndarray:
    """uint8 (H, W, 3), checked as the reward server checks an image."""
    try:
        return decode_image(raw, MAX_PIXELS)
    except ImageTooLargeError as exc:
        raise InputImageError(f"input image {_describe(ref)}: {exc}", "image_too_large") from exc
    except ImageDecodeError as exc:
        raise InputImageError(f"input image {_describe(ref)}: {exc}", "image_unreadable") from exc


def pixels_name(image: np.ndarray) -> str:
    """The stored name of an image: its pixels' SHA-256 (16 hex digits) as a PNG in the dataset's images/."""
    digest = hashlib.sha256(f"{image.shape}".encode() + np.ascontiguousarray(image).tobytes()).hexdigest()[:16]
    return f"images/{digest}.png"


def png_bytes(image: np.ndarray) -> bytes:
    """The image re-encoded as PNG (nothing of the original file but its pixels is kept)."""
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


@lru_cache(maxsize=4096)
def load_image(ref: str) -> np.ndarray:
    """One input image's pixels, read once per process (rows of one source image share it)."""
    image = decode(read_bytes(ref), ref)
    image.flags.writeable = False
    return image


def describe(row: PromptRow) -> str:
    """A row as an error message names it."""
    image = row.images[0] if row.images else ""
    return f"the row {row.prompt!r}" + (f" (input image {_describe(image)})" if image else "")


def load_row_images(images: Sequence[str], where: str) -> list[np.ndarray]:
    """The pixels of a row's input images; a DataError names the row (``where``) and the image."""
    try:
        return [load_image(ref) for ref in images]
    except InputImageError as exc:
        raise InputImageError(f"{where}: {exc}", exc.reason) from exc


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
    import torch  # the light pipeline steps prepare datasets without it

    pixels = torch.from_numpy(np.stack(out)).permute(0, 1, 4, 2, 3).float()
    return pixels / 127.5 - 1.0


def first_inputs(rows: list[list[np.ndarray]], resolution: int) -> np.ndarray:
    """Each row's first input image as the model sees it, (B, R, R, 3) uint8: what a sample grid shows beside the
    sample."""
    return np.stack([square(images[0], resolution) for images in rows])
