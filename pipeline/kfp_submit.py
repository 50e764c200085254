"""`flowgrpo submit`: upload the compiled pipeline to a Kubeflow Pipelines endpoint and start a run.

The pipeline is uploaded once per content (version name = package version + hash of the compiled YAML), so
submitting the same code twice reuses the version; the experiment is created when missing. The bearer
token, when the endpoint needs one, comes from ``$KFP_TOKEN`` (never from an argument or a file).
"""

from __future__ import annotations

import hashlib
import tempfile
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from components import environ
from components.errors import LaunchError
from components.launch.kubernetes.podspec import PIPELINE_SERVICE_ACCOUNT
from pipeline.kfp_pipeline import PIPELINE_NAME, compile_pipeline

# The start of the FutureWarning kfp.Client gives on every construction (kfp 2.x, kfp/client/client.py).
KFP_VERSION_NOTICE = "This client only works with Kubeflow Pipeline v2"


@dataclass(frozen=True)
class Submitted:
    run_id: str
    run_url: str
    pipeline_id: str
    version_id: str
    experiment_id: str


def _version_name(package: Path) -> str:
    digest = hashlib.sha256(package.read_bytes()).hexdigest()[:12]
    return f"{metadata.version('flowgrpo-mlops')}-{digest}"


def _pipeline_version(client, package: Path) -> tuple[str, str]:
    """(pipeline id, version id) of this compiled package, uploading what is missing: the pipeline the first
    time, then one version per distinct package."""
    version_name = _version_name(package)
    pipeline_id = client.get_pipeline_id(PIPELINE_NAME)
    if pipeline_id is None:
        pipeline_id = client.upload_pipeline(str(package), pipeline_name=PIPELINE_NAME).pipeline_id
    for version in client.list_pipeline_versions(pipeline_id, page_size=200).pipeline_versions or []:
        if version.display_name == version_name:
            return pipeline_id, version.pipeline_version_id
    version = client.upload_pipeline_version(str(package), pipeline_version_name=version_name,
                                             pipeline_id=pipeline_id)
    return pipeline_id, version.pipeline_version_id


def submit(host: str, *, experiment: str, run_name: str, arguments: dict, namespace: str | None = None,
           eval_gpus: int = 1, service_account: str = PIPELINE_SERVICE_ACCOUNT) -> Submitted:
    """Compile, upload (if new), and create a run of it in ``experiment`` whose step pods run as
    ``service_account``."""
    import kfp
    from kfp_server_api.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        with warnings.catch_warnings():
            # kfp.Client warns on every construction that it needs KFP >= 2.0.0-beta.2; the README states the
            # KFP 2.x prerequisite, and the notice would precede every one-line error. Only that one is muted.
            warnings.filterwarnings("ignore", message=KFP_VERSION_NOTICE, category=FutureWarning,
                                    module=r"kfp\.client")
            client = kfp.Client(host=host, namespace=namespace, existing_token=environ.KFP_TOKEN.get())
        with tempfile.TemporaryDirectory(prefix="flowgrpo-submit-") as tmp:
            package = compile_pipeline(Path(tmp) / "flowgrpo_pipeline.yaml", eval_gpus=eval_gpus)
            pipeline_id, version_id = _pipeline_version(client, package)
        exp = client.create_experiment(experiment, namespace=namespace)
        run = client.run_pipeline(experiment_id=exp.experiment_id, job_name=run_name, params=arguments,
                                  pipeline_id=pipeline_id, version_id=version_id, service_account=service_account)
    except ApiException as exc:
        raise LaunchError(f"Kubeflow Pipelines at {host} answered {exc.status} {exc.reason}: "
                          f"{(exc.body or '').strip()[:300]}") from exc
    except (HTTPError, OSError) as exc:
        raise LaunchError(f"cannot reach Kubeflow Pipelines at {host}: {exc}") from exc
    return Submitted(run.run_id, f"{host.rstrip('/')}/#/runs/details/{run.run_id}", pipeline_id, version_id,
                     exp.experiment_id)
