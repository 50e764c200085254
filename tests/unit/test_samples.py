"""Sample grids: every tile is its image scaled up exactly, with a caption under it."""

import numpy as np
import pytest

from components.trainer.samples import BACKGROUND, sample_grid, tile_size


def test_tiles_are_the_images_upscaled_and_captions_are_drawn():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 32, 32, 3), dtype=np.uint8)
    grid = sample_grid(images, [f"prompt number {i}" for i in range(5)], [0.5, 1.0, float("nan"), 2.0, 3.0])
    t = tile_size(32)
    assert t == 128  # 32 px scaled by 4
    cols = 3  # ceil(sqrt(5))
    caption_h = (grid.shape[0] // 2) - t
    assert grid.shape == (2 * (t + caption_h), cols * t, 3)
    for i in range(5):
        x, y = (i % cols) * t, (i // cols) * (t + caption_h)
        expected = np.repeat(np.repeat(images[i], 4, axis=0), 4, axis=1)
        assert np.array_equal(grid[y:y + t, x:x + t], expected), i
        caption = grid[y + t:y + t + caption_h, x:x + t]
        assert (caption != np.array(BACKGROUND, np.uint8)).any(), f"caption {i} is blank"
    empty = grid[t + caption_h:, 2 * t:]  # the sixth cell has no image
    assert (empty == np.array(BACKGROUND, np.uint8)).all()


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="as many prompts and rewards"):
        sample_grid(np.zeros((2, 16, 16, 3), np.uint8), ["a"], [1.0, 2.0])
