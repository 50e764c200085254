"""pipeline/services/mlflow_server.py: a real MLflow server keeps its runs in PostgreSQL and proxies artifacts into
SeaweedFS; clients hold no S3 keys. tests/postgres_server.py: no PostgreSQL is a failure that says what to install."""

from __future__ import annotations

from pathlib import Path

import boto3
import mlflow
import numpy as np
import postgres_server  # tests/postgres_server.py
import psycopg
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

    # the run is a row of the server's Postgres database (its own, fresh one), as on the cluster
    assert server.backend_store_uri.startswith("postgresql://")
    with psycopg.connect(server.backend_store_uri) as conn:
        rows = conn.execute("SELECT key, value, step FROM metrics WHERE run_uuid = %s", (run_id,)).fetchall()
    assert rows == [("reward", 0.75, 3)]


def test_no_postgres_installed_fails_and_names_the_install_script(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres_server, "SERVER_BINARIES", str(tmp_path / "postgresql" / "*" / "bin"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(postgres_server.PostgresMissing, match=r"bash scripts/install-debian\.sh"):
        postgres_server.server_binaries()
    installed = tmp_path / "postgresql" / "16" / "bin"  # the newest of several versions
    for version in ("9", "16"):
        (tmp_path / "postgresql" / version / "bin").mkdir(parents=True)
        (tmp_path / "postgresql" / version / "bin" / "postgres").touch()
    assert postgres_server.server_binaries() == installed
