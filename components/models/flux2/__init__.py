"""FLUX.2 [klein], text-to-image or with reference images: the adapter (``adapter.py``) and its tiny twin
(``tiny.py``)."""

from components.models.families import Family, Pipeline, Twin

FAMILY = Family("FLUX.2 klein", (
    # input images: none by default; 0 to 4 references, as many as the run's rows carry (Flux2KleinModel)
    Pipeline("FLUX.2 klein", "Flux2KleinPipeline", f"{__name__}.adapter:Flux2KleinModel",
             (Twin("tiny-flux2", f"{__name__}.tiny:build_tiny_flux2", "cfg", "tiny-flux2-cpu"),)),
))
