"""The registered model: an MLflow pyfunc that loads the base model plus the trained LoRA and makes images.

Artifacts are the LoRA directory (diffusers format) and ``model.json`` (the ``model`` config section and
seed), so ``mlflow.pyfunc.load_model("models:/NAME/VERSION")`` rebuilds exactly what was trained against:
a tiny model from its seed, a real one from its local path or ``s3://`` URI.

``predict`` takes a DataFrame with a ``prompt`` column (and, for an editing or image-to-video model, an
``input_image_b64`` column: the image to edit, base64 PNG or JPEG, squared and scaled to the model's resolution as
in training) and optional ``params`` (``seed``, ``num_inference_steps``, ``guidance_scale``) and returns the
prompts with ``image_png_b64``, or, for a video model, ``video_webp_b64`` (a lossless animated WebP of every
frame).
"""

from __future__ import annotations

import base64
import json
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow.pyfunc

from components.tracking.params import user_tag

MODEL_NAME = "lora"  # the model's name inside the run
# Logged as "models from code" (this file names the class; nothing is pickled), so a model version keeps
# loading as long as the installed package has the class.
ENTRY = Path(__file__).with_name("pyfunc_entry.py")
DEFAULT_PARAMS = {"seed": 0, "num_inference_steps": 28, "guidance_scale": 4.5}
VIDEO_FRAME_MS = 62  # 16 frames per second, Wan2.1's rate
INPUT_COLUMN = "input_image_b64"


def output_column(model_config: dict) -> str:
    """The column ``predict`` fills: PNG images, or animated WebP videos for a model of several frames."""
    return "video_webp_b64" if model_config.get("num_frames", 1) > 1 else "image_png_b64"


class LoRAImageModel(mlflow.pyfunc.PythonModel):
    def load_context(self, context: Any) -> None:
        from components.models.config import ModelConfig
        from components.models.generate import load_with_lora

        spec = json.loads(Path(context.artifacts["model"]).read_text())
        self.config = ModelConfig.model_validate(spec["model"])
        self.model = load_with_lora(self.config, spec["seed"], Path(context.artifacts["lora"]))

    # No type hints here: MLflow would read them as an input schema and override the signature logged below.
    def predict(self, context, model_input, params=None):
        import pandas as pd

        from components.dataset.input_images import MAX_PIXELS, square
        from components.models.generate import generate
        from components.rewards.codec import animated, decode_image_b64, encode_png_b64

        p = {**DEFAULT_PARAMS, **(params or {})}
        prompts = [str(x) for x in model_input["prompt"]]
        column = list(model_input[INPUT_COLUMN]) if INPUT_COLUMN in model_input else []
        inputs = None
        if any(isinstance(x, str) for x in column):
            missing = [i for i, x in enumerate(column) if not isinstance(x, str)]
            if missing:
                raise ValueError(f"{INPUT_COLUMN} is missing on row {missing[0]}: an editing model takes an input "
                                 "image with every prompt")
            inputs = [[square(decode_image_b64(x, MAX_PIXELS), self.config.resolution)] for x in column]
        images = generate(self.model, prompts, resolution=self.config.resolution,
                          num_steps=int(p["num_inference_steps"]), guidance_scale=float(p["guidance_scale"]),
                          seed=int(p["seed"]), images=inputs)
        if images.ndim == 5:
            encoded = [base64.b64encode(animated(video, VIDEO_FRAME_MS)).decode("ascii") for video in images]
        else:
            encoded = [encode_png_b64(img) for img in images]
        return pd.DataFrame({"prompt": prompts, output_column(self.config.model_dump()): encoded})


def _requirements() -> list[str]:
    try:
        return [f"flowgrpo-mlops=={metadata.version('flowgrpo-mlops')}"]
    except metadata.PackageNotFoundError:
        return []


def log_lora_model(run_id: str, name: str, lora_dir: Path, model_config: dict, seed: int) -> str:
    """Log the pyfunc into run ``run_id``, register it as a version of ``name``; returns the version."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    signature = ModelSignature(
        inputs=Schema([ColSpec("string", "prompt"), ColSpec("string", INPUT_COLUMN, required=False)]),
        outputs=Schema([ColSpec("string", "prompt"), ColSpec("string", output_column(model_config))]),
        params=ParamSchema([
            ParamSpec("seed", "long", DEFAULT_PARAMS["seed"]),
            ParamSpec("num_inference_steps", "long", DEFAULT_PARAMS["num_inference_steps"]),
            ParamSpec("guidance_scale", "double", DEFAULT_PARAMS["guidance_scale"]),
        ]),
    )
    with tempfile.TemporaryDirectory(prefix="flowgrpo-model-") as tmp:
        spec = Path(tmp) / "model.json"
        spec.write_text(json.dumps({"model": model_config, "seed": seed}, indent=1))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=MODEL_NAME, python_model=str(ENTRY),
                artifacts={"lora": str(lora_dir), "model": str(spec)},
                pip_requirements=_requirements(), signature=signature, registered_model_name=name,
                tags=user_tag(),  # else MLflow records MLFLOW_TRACKING_USERNAME as the model's (and version's) user
            )
    return str(info.registered_model_version)
