"""Sample image grids: one tile per prompt, captioned with the prompt and its reward; videos animated (GIF for
MLflow, WebP in the report) beside a still grid of their first, middle and last frames."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from components.rewards import codec

MIN_TILE = 128  # tiny models make 32 px images; scale them up so the caption has room and stays legible
CAPTION_LINES = 3
LINE_HEIGHT = 12
BACKGROUND = (255, 255, 255)
TEXT = (0, 0, 0)
FRAME_MS = 100  # 10 frames per second: the few frames of a training video stay visible (GIF counts in 10 ms)


def _wrap(text: str, width_chars: int, lines: int) -> list[str]:
    out: list[str] = []
    rest = " ".join(text.split())
    while rest and len(out) < lines:
        if len(rest) <= width_chars:
            out.append(rest)
            break
        cut = rest.rfind(" ", 0, width_chars + 1)
        cut = cut if cut > 0 else width_chars
        out.append(rest[:cut])
        rest = rest[cut:].lstrip()
    if rest and len(out) == lines and not out[-1].endswith(rest):
        out[-1] = out[-1][: max(width_chars - 1, 0)] + "…"
    return out


def tile_size(image_size: int) -> int:
    """The integer upscale of ``image_size`` that is at least MIN_TILE pixels."""
    return image_size * max(1, math.ceil(MIN_TILE / image_size))


def _scale(h: int, w: int) -> int:
    """One integer upscale for both sides (a key-frame strip keeps its aspect), the shorter side >= MIN_TILE."""
    return tile_size(min(h, w)) // min(h, w)


def key_frames(videos: np.ndarray) -> np.ndarray:
    """(N, F, H, W, 3) videos -> (N, H, 3 W, 3): each video's first, middle and last frames side by side."""
    f = videos.shape[1]
    return np.concatenate([videos[:, 0], videos[:, f // 2], videos[:, f - 1]], axis=2)


def animated(video: np.ndarray, image_format: str = "WEBP") -> bytes:
    """(F, H, W, 3) uint8 -> a looping animation (``codec.animated``), scaled up (nearest) as the grid's tiles are."""
    scale = _scale(*video.shape[1:3])
    return codec.animated(video.repeat(scale, axis=1).repeat(scale, axis=2), FRAME_MS, image_format)


def sample_grid(images: np.ndarray, prompts: list[str], rewards: list[float], label: str = "reward",
                inputs: np.ndarray | None = None) -> np.ndarray:
    """(N, H, W, 3) uint8 images -> one uint8 grid image; each tile is the image scaled up by an integer
    factor (nearest) with "prompt" and "<label> <reward>" lines under it. Videos (N, F, H, W, 3) tile their
    first, middle and last frames (``key_frames``). ``inputs`` (N, H, W, 3): each sample's input image, shown on
    the tile's left (an edit beside what it edited)."""
    if images.ndim == 5:
        images = key_frames(images)
    if inputs is not None:
        images = np.concatenate([inputs, images], axis=2)
    n, h, w, _ = images.shape
    if not (n == len(prompts) == len(rewards)) or n == 0:
        raise ValueError(f"sample_grid needs as many prompts and rewards as images, got {n}/{len(prompts)}/"
                         f"{len(rewards)}")
    th, tw = h * _scale(h, w), w * _scale(h, w)
    caption_h = (CAPTION_LINES + 1) * LINE_HEIGHT + 4
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = Image.new("RGB", (cols * tw, rows * (th + caption_h)), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    chars = max(tw // 6, 4)
    for i in range(n):
        x, y = (i % cols) * tw, (i // cols) * (th + caption_h)
        grid.paste(Image.fromarray(images[i]).resize((tw, th), Image.Resampling.NEAREST), (x, y))
        reward = "failed" if not math.isfinite(rewards[i]) else f"{rewards[i]:.4g}"
        lines = [*_wrap(prompts[i], chars, CAPTION_LINES), f"{label} {reward}"]
        for j, line in enumerate(lines):
            draw.text((x + 2, y + th + 2 + j * LINE_HEIGHT), line, fill=TEXT, font=font)
    return np.asarray(grid)
