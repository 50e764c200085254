"""Services shared by the integration modules: one real SeaweedFS, PostgreSQL and MLflow server per session (per
pytest-xdist worker). MLflow keeps its runs and registry in Postgres, as the cluster's does."""

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from postgres_server import PostgresServer, postgres_cluster, running_postgres  # tests/postgres_server.py

from components import environ
from pipeline.services.mlflow_server import MlflowServer, running_mlflow
from pipeline.services.seaweed import SeaweedS3, running_seaweed


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """SeaweedFS with credentials enforced; tests use their own prefixes in its bucket."""
    with running_seaweed(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3_env(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> SeaweedS3:
    """Point boto3 (here and in subprocesses) at the test server through the environment only, as in
    production, and as `run --local` does (``own_s3``): a developer's AWS (~/.aws, a session token) must not
    change what the tests see, nor their AWS_MAX_ATTEMPTS the retries they count."""
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    for name, value in environ.own_s3(seaweed.env()).items():
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
    return seaweed


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of its own; each MLflow server on it gets a fresh database (``new_database``)."""
    with postgres_cluster() as data, running_postgres(data) as server:
        yield server


@pytest.fixture(scope="session")
def services(seaweed: SeaweedS3, postgres: PostgresServer,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SeaweedS3, MlflowServer]]:
    """SeaweedFS and an MLflow server whose runs live in Postgres and whose artifacts live in SeaweedFS."""
    with running_mlflow(tmp_path_factory.mktemp("mlflow"), s3=seaweed,
                        backend_store_uri=postgres.new_database()) as mlflow:
        yield seaweed, mlflow


@pytest.fixture
def env(services, s3_env, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """This test's environment points at both services; returns what it set."""
    s3, mlflow = services
    values = {**s3.env(), **mlflow.env(), "FLOWGRPO_CACHE_DIR": str(tmp_path / "cache"),
              "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


@pytest.fixture(params=["s3", "path", "file-uri"])
def root(request: pytest.FixtureRequest, seaweed: SeaweedS3, tmp_path: Path) -> str:
    """A fresh folder in each notation the storage API accepts."""
    if request.param == "s3":
        return f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:10]}"
    if request.param == "path":
        return str(tmp_path / "store")
    return (tmp_path / "store").as_uri()
