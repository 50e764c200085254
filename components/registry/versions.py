"""Model versions: a trained LoRA registered as a new version of a registered model, and the promotion gate's
verdict recorded on it (tags, and the alias when promoted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from components.tracking.params import redact, short_error
from components.tracking.server import mlflow_client, tracking_uri


def register_lora_version(run_id: str, name: str, lora_dir: Path, model_config: dict, seed: int,
                          tags: dict[str, str], log: Callable[[str], None] = print) -> str:
    """Log the LoRA as a pyfunc model into run ``run_id``, register it as a new version of ``name``, tag
    the version; returns the version."""
    from components.registry.pyfunc_model import log_lora_model  # mlflow.pyfunc loads slowly: only when used

    version = log_lora_model(run_id, name, lora_dir, model_config, seed)
    client = mlflow_client()
    for key, value in {**tags, "flowgrpo.run_id": run_id}.items():
        client.set_model_version_tag(name, version, key, value)
    log(f"registered {name} version {version} in the MLflow Model Registry")
    return version


def apply_gate(name: str, version: str, promoted: bool, reason: str, alias: str,
               log: Callable[[str], None] = print) -> bool:
    """Tag version ``version`` of ``name`` with the verdict and reason; set ``alias`` on it when promoted.
    Returns whether the registry was updated (tracking off or MLflow failing is reported, not raised: the
    verdict stays in eval.json and the report)."""
    uri = tracking_uri()
    if not uri:
        log(f"promotion gate: {'promote' if promoted else 'refuse'} ({reason}); no registry (MLFLOW_TRACKING_URI "
            "is not set)")
        return False
    from mlflow.exceptions import MlflowException

    client = mlflow_client(uri)
    try:
        client.set_model_version_tag(name, version, "flowgrpo.gate", "promoted" if promoted else "refused")
        client.set_model_version_tag(name, version, "flowgrpo.gate_reason", reason)
        if promoted:
            client.set_registered_model_alias(name, alias, version)
        elif _alias_version(client, name, alias) == str(version):  # a re-evaluation took the promotion back
            client.delete_registered_model_alias(name, alias)
    except MlflowException as exc:
        log(f"promotion gate: could not update {name} version {version} at {redact(uri)}: "
            f"{short_error(exc)}")
        return False
    verdict = f"alias {alias!r} set" if promoted else "not promoted"
    log(f"promotion gate: {name} version {version} {verdict}: {reason}")
    return True


def _alias_version(client, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None
