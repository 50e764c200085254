"""MLflow tracking and the registered LoRA model. The only package that imports mlflow."""
