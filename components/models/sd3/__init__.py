"""Stable Diffusion 3.x: the adapter (``adapter.py``) and its tiny twin (``tiny.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("SD3.x", (
    Pipeline("Stable Diffusion 3.x", "StableDiffusion3Pipeline", f"{__name__}.adapter:SD3Model",
             (Twin("tiny-sd3", f"{__name__}.tiny:build_tiny_sd3", "cfg", "tiny-cpu"),)),
))
