"""pipeline/services/mlflow_server.py: a real MLflow server proxies artifacts into SeaweedFS; clients hold no
S3 keys."""

from __future__ import annotations

from pathlib import Path

import boto3
import mlflow
import numpy as np
import pytest
from botocore.config import Config


def test_server_logs_metrics_and_proxies_artifacts_into_s3(services, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    s3, server = services
    # The client side must work with the tracking URL alone: no S3 keys or endpoint.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL_S3",
                 "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    client = mlflow.MlflowClient(server.url)
    run_id = client.create_run(client.create_experiment("helper-test")).info.run_id
    client.log_metric(run_id, "reward", 0.75, step=3)
    client.log_image(run_id, np.zeros((8, 8, 3), dtype=np.uint8), key="k", step=1)
    (tmp_path / "note.txt").write_text("hello")
    client.log_artifact(run_id, str(tmp_path / "note.txt"))

    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward")] == [(3, 0.75)]
    assert "note.txt" in [f.path for f in client.list_artifacts(run_id)]
    raw = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                       aws_secret_access_key=s3.secret_key, region_name=s3.region,
                       config=Config(s3={"addressing_style": "path"}))
    keys = [o["Key"] for o in raw.list_objects_v2(Bucket=s3.bucket, Prefix="mlflow/").get("Contents", [])]
    assert any(k.endswith(f"/{run_id}/artifacts/note.txt") for k in keys), keys
    assert any("/images/" in k and k.endswith(".png") for k in keys), keys
