"""Qwen-Image and Qwen-Image-Edit-2509, which edits an input image: the adapters (``adapter.py``, ``edit.py``) and
their tiny twins (``tiny.py``, ``tiny_edit.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("Qwen-Image", (
    Pipeline("Qwen-Image", "QwenImagePipeline", f"{__name__}.adapter:QwenImageModel",
             (Twin("tiny-qwenimage", f"{__name__}.tiny:build_tiny_qwenimage", "true_cfg", "tiny-qwenimage-cpu"),)),
    Pipeline("Qwen-Image-Edit-2509", "QwenImageEditPlusPipeline",
             f"{__name__}.edit:QwenImageEditModel",
             (Twin("tiny-qwenimage-edit", f"{__name__}.tiny_edit:build_tiny_qwenimage_edit", "true_cfg",
                   "tiny-qwenimage-edit-cpu"),), input_images=1),
))
