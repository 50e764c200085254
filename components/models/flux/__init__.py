"""FLUX.1 and FLUX.1-Kontext, which edits an input image: the adapters (``adapter.py``, ``kontext.py``) and their
tiny twin (``tiny.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("FLUX.1", (
    Pipeline("FLUX.1-dev / schnell", "FluxPipeline", f"{__name__}.adapter:FluxModel",
             (Twin("tiny-flux", f"{__name__}.tiny:build_tiny_flux", "embedded", "tiny-flux-cpu"),)),
    Pipeline("FLUX.1-Kontext-dev", "FluxKontextPipeline", f"{__name__}.kontext:FluxKontextModel",
             (Twin("tiny-flux-kontext", f"{__name__}.tiny:build_tiny_flux_kontext", "embedded",
                   "tiny-flux-kontext-cpu"),), input_images=1),
))
