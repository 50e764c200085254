"""A row's input images (editing, image-to-video): where they are, read and checked as hostile input, and made
the size the model takes.

A reference is a path relative to the file that names it, a ``data:image/...;base64,`` URL (the built-in sets
inline theirs) or, with ``data.allow_external_images``, an absolute path or an ``s3://`` URI. A relative path must
stay inside the folder of its file, symbolic links followed (``resolve``): a dataset reads only what it holds.
Every image passes the reward server's rules before a pixel is decoded: at most ``MAX_IMAGE_BYTES`` (from the
file's size, before a byte is read), PNG or JPEG, at most ``MAX_PIXELS`` pixels read from the header (a
decompression bomb costs nothing), a file that decodes whole. A row takes at most ``MAX_IMAGES_PER_ROW``.
Decoded images are kept in one cache of at most ``CACHE_BYTES``, one entry per file however it is named.

A model here makes square images of ``model.resolution`` px, and it edits at that size too: an input image is
cropped to its centre square and resized there (Lanczos, as diffusers' image processor resizes). Two sizes are
refused rather than distorted (docs/DATASETS.md): a side ratio over ``MAX_ASPECT`` (the crop would drop more than
half the picture, and with it what the instruction may name) and a shorter side under ``MIN_SIDE_FRACTION`` of the
resolution (an upscale that far invents the detail the edit should keep).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from components import storage
from components.dataset.prepared import IMAGES_DIR, PromptRow
from components.errors import DataError
from components.rewards.codec import ImageDecodeError, ImageTooLargeError, decode_image, image_bytes_b64

if TYPE_CHECKING:
    import torch

MAX_PIXELS = 4096 * 4096  # the reward server's default per image
# An 8-bit RGBA PNG at the pixel limit stored uncompressed, and 1 MiB for its other chunks: no legitimate input
# image is larger, so a larger file is refused from its size, unread.
MAX_IMAGE_BYTES = 4 * MAX_PIXELS + 2**20
# The most input images any family takes with a prompt: FLUX.2 klein's references (Black Forest Labs' "up to 4";
# FLUX.1-Kontext, Qwen-Image-Edit and Wan2.1 I2V take 1). docs/DATASETS.md.
MAX_IMAGES_PER_ROW = 4
# Decoded pixels kept per process: ten images at the pixel limit, or 170 of 1024 x 1024. Past it the least
# recently used go (and are read again when next needed).
CACHE_BYTES = 512 * 2**20
DATA_URL = "data:"
EXTERNAL_OPT_IN = "data.allow_external_images: true (prepare-dataset --allow-external-images)"
MAX_ASPECT = 2.0
MIN_SIDE_FRACTION = 0.25


class InputImageError(DataError):
    """An input image that is missing, unreadable or too large; ``reason`` is a `prepare-dataset` reason key."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def resolve(ref: str, base: str, allow_external: bool = False) -> str:
    """A reference as given in a row of the file ``base``: a relative path joined to the file's folder, where it
    must stay (``storage.within``: a local path comes back real, its symbolic links resolved); an absolute path
    or a URI only with ``allow_external``; a data: URL as it is. InputImageError (reason ``image_outside``)
    otherwise."""
    if ref.startswith(DATA_URL):
        return ref
    if storage.is_uri(ref) or PurePosixPath(ref).is_absolute():
        if allow_external:
            return ref
        raise InputImageError(f"input image {ref[:200]}: an absolute path or URI is read only with {EXTERNAL_OPT_IN}; "
                              "else give it relative to the file that names it, inside its folder", "image_outside")
    # a path's parent would fold a URI's "//"
    folder = base.rsplit("/", 1)[0] if storage.is_uri(base) else str(PurePosixPath(base).parent)
    inside = storage.within(folder, ref)
    if inside is None:
        raise InputImageError(f"input image {ref[:200]}: leads outside {folder}, the folder of the file that names "
                              "it (by '..' or a symbolic link); a relative path must stay inside it", "image_outside")
    return inside


def _describe(ref: str) -> str:
    return "an inline data: URL" if ref.startswith(DATA_URL) else ref


def read_bytes(ref: str) -> bytes:
    """The file bytes of one reference, at most ``MAX_IMAGE_BYTES`` (a larger one is refused from its size, before
    it is read); InputImageError (reason ``image_missing``, ``image_too_large``) when there are none."""
    if ref.startswith(DATA_URL):
        if (len(ref) - len(ref.partition(",")[0])) // 4 * 3 > MAX_IMAGE_BYTES:
            raise InputImageError(f"input image {_describe(ref)}: {len(ref)} characters, over the limit of "
                                  f"{MAX_IMAGE_BYTES} bytes decoded", "image_too_large")
        try:
            return image_bytes_b64(ref)
        except ImageDecodeError as exc:
            raise InputImageError(f"input image {_describe(ref)}: {exc}", "image_unreadable") from exc
    try:
        if not storage.exists(ref):
            raise InputImageError(f"input image {ref} does not exist", "image_missing")
        return storage.get_bytes(ref, MAX_IMAGE_BYTES)
    except storage.ObjectTooLargeError as exc:
        raise InputImageError(f"input image {exc}", "image_too_large") from exc
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
    return f"{IMAGES_DIR}/{digest}.png"


def png_bytes(image: np.ndarray) -> bytes:
    """The image re-encoded as PNG (nothing of the original file but its pixels is kept)."""
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _identity(ref: str) -> Hashable:
    """What makes two references one image: a local file's device, inode, size and modification time (all its
    names, links and symbolic links are one; an edited file is another), an S3 URI or a data: URL as written."""
    if ref.startswith(DATA_URL) or storage.is_uri(ref):
        return ref
    try:
        st = os.stat(ref)
    except OSError:  # missing or unreadable: read_bytes says which
        return ref
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class _ImageCache:
    """Decoded images by ``_identity``, least recently used first out past ``CACHE_BYTES``."""

    def __init__(self) -> None:
        self._images: OrderedDict[Hashable, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def get(self, key: Hashable) -> np.ndarray | None:
        with self._lock:
            image = self._images.get(key)
            if image is not None:
                self._images.move_to_end(key)
            return image

    def put(self, key: Hashable, image: np.ndarray) -> None:
        with self._lock:
            if key in self._images:
                return
            self._images[key] = image
            self.nbytes += image.nbytes
            while self.nbytes > CACHE_BYTES:
                self.nbytes -= self._images.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self._images.clear()
            self.nbytes = 0


_cache = _ImageCache()


def load_image(ref: str) -> np.ndarray:
    """One input image's pixels (read only), checked (``read_bytes``, ``decode``); the rows of one source image
    share them through the cache while they fit in it."""
    key = _identity(ref)
    image = _cache.get(key)
    if image is None:
        image = decode(read_bytes(ref), ref)
        image.flags.writeable = False
        _cache.put(key, image)
    return image


def check_image(ref: str, resolution: int | None) -> np.ndarray:
    """One input image's pixels after every check a run makes of it: ``load_image``'s and, given the model's
    ``resolution``, ``size_problem``'s. InputImageError with its reason. prepare-dataset, validate and train
    check an image with this one function."""
    image = load_image(ref)
    problem = size_problem(image.shape[0], image.shape[1], resolution) if resolution else None
    if problem:
        raise InputImageError(f"input image {_describe(ref)}: {problem}", "image_size")
    return image


def too_many(count: int) -> str | None:
    """Why a row cannot carry ``count`` input images, or None."""
    if count > MAX_IMAGES_PER_ROW:
        return (f"{count} input images; a model takes at most {MAX_IMAGES_PER_ROW} with a prompt (FLUX.2 klein's "
                "references; the other editing and image-to-video families take 1)")
    return None


def _same_number(counts: set[int]) -> None:
    if len(counts) > 1:
        raise DataError(f"rows carry different numbers of input images ({sorted(counts)}); a model takes the same "
                        "number with every prompt")


def check_rows(rows: Sequence[PromptRow], resolution: int) -> None:
    """Every check training makes of its rows' input images as it encodes them (``load_row_images``), made at once
    for all of them, as `validate` does: at most ``MAX_IMAGES_PER_ROW`` a row, as many in every row, each distinct
    image through ``check_image`` (what stays in memory is the cache's). An InputImageError (a DataError) names
    the first row at fault with training's line."""
    for row in rows:
        problem = too_many(len(row.images))
        if problem:
            raise InputImageError(f"{describe(row)}: {problem}", "too_many_images")
    _same_number({len(row.images) for row in rows})
    seen: set[str] = set()
    for row in rows:
        for ref in row.images:
            if ref not in seen:
                seen.add(ref)
                try:
                    check_image(ref, resolution)
                except InputImageError as exc:
                    raise InputImageError(f"{describe(row)}: {exc}", exc.reason) from exc


def describe(row: PromptRow) -> str:
    """A row as an error message names it."""
    image = row.images[0] if row.images else ""
    return f"the row {row.prompt!r}" + (f" (input image {_describe(image)})" if image else "")


def load_row_images(images: Sequence[str], where: str, resolution: int | None = None) -> list[np.ndarray]:
    """The pixels of a row's input images, each through ``check_image`` (at the model's ``resolution`` when given);
    an InputImageError names the row (``where``) and the image."""
    try:
        return [check_image(ref, resolution) for ref in images]
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


def model_input(rows: list[list[np.ndarray]], resolution: int) -> torch.Tensor:
    """Each row's input images (uint8 (H, W, 3), checked at ``resolution`` by ``load_row_images``) as the adapters
    take them: (B, N, 3, R, R) float32 in [-1, 1]."""
    _same_number({len(images) for images in rows})
    out = [np.stack([square(image, resolution) for image in images]) for images in rows]
    import torch  # the light pipeline steps prepare datasets without it

    pixels = torch.from_numpy(np.stack(out)).permute(0, 1, 4, 2, 3).float()
    return pixels / 127.5 - 1.0


def first_inputs(rows: list[list[np.ndarray]], resolution: int) -> np.ndarray:
    """Each row's first input image as the model sees it, (B, R, R, 3) uint8: what a sample grid shows beside the
    sample."""
    return np.stack([square(images[0], resolution) for images in rows])
