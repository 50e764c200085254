"""The file MLflow runs to build the registered model (``models from code``); see pyfunc_model.py."""

from mlflow.models import set_model

from components.registry.pyfunc_model import LoRAImageModel

set_model(LoRAImageModel())
