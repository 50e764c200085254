"""The Model Registry side of promotion: record the gate's verdict on a model version, alias it if promoted."""

from __future__ import annotations

import os
from collections.abc import Callable

from components.tracking.params import redact, short_error
from components.tracking.tracker import TRACKING_URI_ENV


def apply_gate(name: str, version: str, promoted: bool, reason: str, alias: str,
               log: Callable[[str], None] = print) -> bool:
    """Tag version ``version`` of ``name`` with the verdict and reason; set ``alias`` on it when promoted.
    Returns whether the registry was updated (tracking off or MLflow failing is reported, not raised: the
    verdict stays in eval.json and the report)."""
    uri = os.environ.get(TRACKING_URI_ENV)
    if not uri:
        log(f"promotion gate: {'promote' if promoted else 'refuse'} ({reason}); no registry ({TRACKING_URI_ENV} "
            "is not set)")
        return False
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
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
