"""Images on the wire: base64 PNG out, base64 PNG/JPEG in, with size checks before decoding."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
from collections.abc import Iterator

import numpy as np
from PIL import Image, UnidentifiedImageError


class ImageDecodeError(ValueError):
    """An image that cannot be decoded."""


class ImageTooLargeError(ImageDecodeError):
    """An image with more pixels than allowed (found from its header, before decoding)."""


def encode_png_b64(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def animated(video: np.ndarray, frame_ms: int, image_format: str = "WEBP") -> bytes:
    """(F, H, W, 3) uint8 -> a looping animation written by Pillow (no ffmpeg): a lossless WebP, every pixel kept,
    or a GIF (256 colours a frame), which MLflow's artifact view plays where it shows no WebP."""
    frames = [Image.fromarray(np.ascontiguousarray(f)) for f in video]
    buffer = io.BytesIO()
    lossless = {"lossless": True} if image_format == "WEBP" else {}
    frames[0].save(buffer, format=image_format, save_all=True, append_images=frames[1:], duration=frame_ms, loop=0,
                   **lossless)
    return buffer.getvalue()


def encode_raw_b64(images: np.ndarray) -> str:
    """uint8 pixels in C order, base64: lossless like PNG at a small fraction of its encoding cost."""
    return base64.b64encode(np.ascontiguousarray(images, dtype=np.uint8).tobytes()).decode("ascii")


def decode_raw_b64(data: str, shape: tuple[int, ...], max_pixels: int) -> np.ndarray:
    """(B, H, W, 3) uint8 images, or (B, F, H, W, 3) videos, from ``encode_raw_b64``. The shape and the data's
    length are checked before anything is allocated: a client-sent shape such as (1, 0, 2**62, 3) holds no bytes
    but no array can have it."""
    *lead, h, w, c = shape
    if c != 3 or h < 1 or w < 1 or len(lead) not in (1, 2) or min(lead[1:], default=1) < 1:
        raise ImageDecodeError(f"pixels.shape must be (B, H, W, 3) or (B, F, H, W, 3) with F, H and W at least 1, "
                               f"got {tuple(shape)}")
    if h * w > max_pixels:
        raise ImageTooLargeError(f"{w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}")
    size = math.prod(shape)
    held = len(data) // 4 * 3 - data[-2:].count("=")  # what the base64 decodes to, if valid: known before decoding
    if held != size:
        raise ImageDecodeError(f"pixels.data holds {held} bytes but shape {tuple(shape)} needs {size}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageDecodeError(f"pixels.data is not valid base64 ({exc})") from exc
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def image_bytes_b64(data: str) -> bytes:
    """The file bytes of a base64 image (plain base64 or a data URL)."""
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageDecodeError(f"not valid base64 ({exc})") from exc


@contextlib.contextmanager
def _opened(raw: bytes, max_pixels: int) -> Iterator[Image.Image]:
    """The image with its header read and checked (size, format), nothing decoded yet. Whatever Pillow raises
    on a malformed file (a bad chunk, an oversized zTXt or iCCP profile, a truncation) is an ``ImageDecodeError``."""
    try:
        with Image.open(io.BytesIO(raw)) as im:
            width, height = im.size
            if width * height > max_pixels:
                raise ImageTooLargeError(
                    f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}")
            if im.format not in ("PNG", "JPEG"):
                raise ImageDecodeError(f"format {im.format} is not PNG or JPEG")
            yield im
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own header check, above its larger global limit
        raise ImageTooLargeError(f"{exc} (limit {max_pixels} pixels)") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise ImageDecodeError(f"cannot decode image ({type(exc).__name__}: {exc})") from exc


def image_pixels(raw: bytes, max_pixels: int) -> int:
    """Pixels of one PNG/JPEG, from its header only (a request's budget is checked before decoding)."""
    with _opened(raw, max_pixels) as im:
        return im.size[0] * im.size[1]


def decode_image_b64(data: str, max_pixels: int) -> np.ndarray:
    """uint8 (H, W, 3). Accepts plain base64 or a data URL. The pixel count is checked from the header,
    before any pixel is decoded, so a decompression bomb costs nothing."""
    return decode_image(image_bytes_b64(data), max_pixels)


def decode_image(raw: bytes, max_pixels: int) -> np.ndarray:
    """uint8 (H, W, 3) from PNG/JPEG file bytes, the header checked first (see ``decode_image_b64``)."""
    with _opened(raw, max_pixels) as im:
        try:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
        except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
            raise ImageDecodeError(f"cannot decode image ({type(exc).__name__}: {exc})") from exc
