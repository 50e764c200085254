"""Z-Image (base and Turbo): the adapter (``adapter.py``) and its tiny twin (``tiny.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("Z-Image", (
    Pipeline("Z-Image", "ZImagePipeline", f"{__name__}.adapter:ZImageModel",
             (Twin("tiny-zimage", f"{__name__}.tiny:build_tiny_zimage", "cfg", "tiny-zimage-cpu"),)),
))
