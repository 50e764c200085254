"""Wan2.1 text-to-video and image-to-video: the adapters (``adapter.py``, ``i2v.py``) and their tiny twins
(``tiny.py``, ``tiny_i2v.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("Wan2.1", (
    Pipeline("Wan2.1 text-to-video", "WanPipeline", f"{__name__}.adapter:WanModel",
             (Twin("tiny-wan", f"{__name__}.tiny:build_tiny_wan", "cfg", "tiny-wan-cpu"),), video=True),
    Pipeline("Wan2.1 image-to-video", "WanImageToVideoPipeline", f"{__name__}.i2v:WanImageToVideoModel",
             (Twin("tiny-wan-i2v", f"{__name__}.tiny_i2v:build_tiny_wan_i2v", "cfg", "tiny-wan-i2v-cpu"),),
             video=True, input_images=1),
))
