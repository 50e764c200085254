"""The `tracking:` section: the MLflow experiment a run logs to and the model it registers."""

from __future__ import annotations

from pydantic import Field, field_validator

from components.config_base import Section


class TrackingConfig(Section):
    """What goes to MLflow. Where it goes comes from MLFLOW_TRACKING_URI only; unset = no tracking."""

    experiment: str = Field(default="flowgrpo", min_length=1, description="MLflow experiment name")
    sample_every: int = Field(default=10, ge=0,
                              description="epochs between sample image grids (epoch 0, the base model, and the last "
                                          "epoch too); 0 = none")
    sample_images: int = Field(default=8, ge=1, le=64, description="most tiles per sample grid (one per prompt)")
    system_metrics: bool = Field(default=True, description="log CPU/GPU/memory/disk/network as system/* metrics")
    registered_model: str | None = Field(
        default="flowgrpo-lora", min_length=1,
        description="Model Registry name the final LoRA is registered under (no '/' or ':'); null = do not "
                    "register",
    )

    @field_validator("registered_model")
    @classmethod
    def _registry_name(cls, value: str | None) -> str | None:
        # refused here, not by MLflow at the end of a finished run
        if value is not None and any(c in value for c in "/:"):
            raise ValueError("MLflow model names cannot contain '/' or ':'")
        return value
