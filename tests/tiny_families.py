"""The tiny twins the family tests run, read from the family registry (components/models/families.py): a family
added there is in every test that takes them."""

from __future__ import annotations

from pathlib import Path

from components.models.families import pipelines, tiny_twins
from pipeline.config import CONFIG_DIR


def recipe(kind: str) -> Path:
    """The config that trains the tiny twin ``kind`` on a CPU."""
    return CONFIG_DIR / f"{tiny_twins()[kind].recipe}.yaml"


def text_twins(video: bool = True) -> list[str]:
    """The tiny twins of the pipelines that make images (and video, with ``video``) from text alone."""
    registered = pipelines()
    return [kind for kind, twin in tiny_twins().items()
            if not registered[twin.pipeline].input_images and (video or not registered[twin.pipeline].video)]
