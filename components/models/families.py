"""The model family registry. Each family is a folder of this package (``components/models/<family>/``) whose
``__init__.py`` registers, as ``FAMILY``, the diffusers pipelines it adapts: each pipeline's adapter, tiny twin and
its guidance, whether it makes video, and the input images a prompt comes with. The `model:` section (its ``kind``
values), the loader, the family tests and the docs' family lists all read them here (docs/MODELS.md, "Adding a
family").

The folders are found without being listed, as the algorithms are. Neither this module nor a family's
``__init__.py`` imports torch: the `model:` section is validated where torch is not installed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, replace
from typing import Any, Literal

# How a pipeline guides sampling (docs/MODELS.md): `cfg` batches a negative-prompt pass with the prompt (SD3,
# FLUX.2 klein base); `true_cfg` runs it separately and rescales to the conditional norm (Qwen-Image); `embedded`
# feeds the scale to a guidance-distilled transformer (FLUX.1-dev); `none` has neither (FLUX.1-schnell, the
# step-distilled FLUX.2 klein). A twin's mode is registered; the adapter of a loaded pipeline reports its own.
GuidanceMode = Literal["cfg", "true_cfg", "embedded", "none"]
SHAPES_RESOLUTION = 48  # the demo models' training resolution; their position embeddings know no other size
_PACKAGE = "components.models"


@dataclass(frozen=True)
class Twin:
    """A ``model.kind`` built in code, offline: a family's tiny twin (random weights from the seed), or a demo model
    on shipped weights."""

    kind: str
    builder: str  # "module:function", called (resolution, seed) -> the pipeline in eval mode, float32
    guidance: GuidanceMode
    recipe: str  # the config that trains it on a CPU: pipeline/configs/<recipe>.yaml
    about: str = ""  # what it is, in model.kind's description; a tiny twin's: "random <its pipeline>"
    resolution: int | None = None  # the one resolution it makes (a demo model's); None: any
    pipeline: str = ""  # the class it builds: the registry fills it in from the Pipeline it is registered under


@dataclass(frozen=True)
class Pipeline:
    """A diffusers pipeline class the trainer adapts."""

    name: str  # the model, as the docs name it
    pipeline: str  # the class, as model_index.json's `_class_name` names it
    adapter: str  # "module:Class", its FlowMatchingModel
    twins: tuple[Twin, ...] = ()
    video: bool = False  # the adapter's ``video``: latents with a time axis, model.num_frames frames
    input_images: int = 0  # the adapter's ``input_images``: each prompt's input images (editing, image-to-video)


@dataclass(frozen=True)
class Family:
    """One folder of components/models: a model family and the pipelines it adapts."""

    name: str
    pipelines: tuple[Pipeline, ...]


# The demo models on the shapes world (shapes_sd3.py, shapes_kontext.py): twins of the pipelines they are, built from
# the weights shipped in weights/
DEMOS = (
    Twin("shapes-sd3", "components.models.shapes_sd3:load_shapes_sd3", "cfg", "shapes-cpu",
         f"the shipped demo model pretrained on drawn shapes ({SHAPES_RESOLUTION} px)", SHAPES_RESOLUTION,
         pipeline="StableDiffusion3Pipeline"),
    Twin("shapes-kontext", "components.models.shapes_kontext:load_shapes_kontext", "none", "shapes-edit-cpu",
         "the shipped editing demo model (FLUX.1-Kontext on shapes-sd3's VAE and encoders, "
         f"{SHAPES_RESOLUTION} px)", SHAPES_RESOLUTION, pipeline="FluxKontextPipeline"),
)


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family folder's registration, the folders in name order; once a process."""
    package = importlib.import_module(_PACKAGE)
    found = {f"components/models/{module.name}/": importlib.import_module(f"{_PACKAGE}.{module.name}").FAMILY
             for module in pkgutil.iter_modules(package.__path__) if module.ispkg}
    _refuse_twice("pipeline", [(p.pipeline, folder) for folder, f in found.items() for p in f.pipelines])
    _refuse_twice("model.kind", [(t.kind, folder) for folder, f in found.items() for p in f.pipelines
                                 for t in p.twins] + [(t.kind, "components/models/families.py") for t in DEMOS])
    return tuple(found.values())


def _refuse_twice(what: str, registered: list[tuple[str, str]]) -> None:
    """Refuse a name (``what``) that two places register: (name, place) pairs."""
    places: dict[str, list[str]] = {}
    for name, place in registered:
        places.setdefault(name, []).append(place)
    twice = [f"{' and '.join(where)} both register the {what} {name}" for name, where in places.items()
             if len(where) > 1]
    if twice:
        raise ValueError(f"{'; '.join(twice)}: each is registered by one family folder")


def pipelines() -> dict[str, Pipeline]:
    """Every registered pipeline, by class name."""
    return {p.pipeline: p for f in families() for p in f.pipelines}


def tiny_twins() -> dict[str, Twin]:
    """The families' tiny twins by kind, each naming its pipeline class."""
    return {t.kind: replace(t, pipeline=p.pipeline) for p in pipelines().values() for t in p.twins}


def twins() -> dict[str, Twin]:
    """Every ``model.kind`` built in code: the tiny twins, then the demo models."""
    return {**tiny_twins(), **{t.kind: t for t in DEMOS}}


def load(spec: str) -> Any:
    """The object a ``module:name`` spec names (an adapter class, a twin's builder), its module imported now."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)
