"""Run a real ``mlflow server`` (its own process) on a loopback port: for `flowgrpo run --local` and the tests.

Its backend store is a sqlite file in its folder (the laptop default), or any database SQLAlchemy reaches, such as
the ``postgresql://`` store the cluster's server uses (the tests run theirs on Postgres).

Artifacts are proxied by the server (``--artifacts-destination``), so clients need only the tracking URL:
into SeaweedFS when an ``s3`` is given, else into a local folder.
"""

from __future__ import annotations

import contextlib
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from components import environ
from components.launch.process import Lease, free_ports, running_process, venv_binary
from pipeline.services.seaweed import SeaweedS3


@dataclass(frozen=True)
class MlflowServer:
    """Where a running MLflow tracking server answers, and where it keeps runs and the registry."""

    url: str
    port: int
    backend_store_uri: str

    def env(self) -> dict[str, str]:
        """The environment a client (or the pipeline) needs to log to this server."""
        return {"MLFLOW_TRACKING_URI": self.url}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_mlflow(workdir: Path, s3: SeaweedS3 | None = None, port: int | None = None,
                   timeout_s: float = 90, host: str = "127.0.0.1", lease: Lease | None = None,
                   backend_store_uri: str | None = None) -> Iterator[MlflowServer]:
    """Start ``mlflow server`` with its db (and local artifacts) under ``workdir``, wait for ``/health``,
    yield it, then stop its whole process group (also fine if it already died).

    ``backend_store_uri``: where runs and the registry live instead of ``workdir``'s sqlite file, e.g.
    ``postgresql://USER@HOST:PORT/DB`` (an empty database: MLflow creates its tables).

    ``port`` pins the port, so a test can stop a server and start another where clients still point; ``host`` is
    the address it listens on; with a ``lease`` it stops when the lease's owner is gone.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_ports(1)[0]
    store = backend_store_uri or f"sqlite:///{workdir / 'mlflow.db'}"
    server = MlflowServer(url=f"http://{host}:{port}", port=port, backend_store_uri=store)
    args = [venv_binary("mlflow", "mlflow"), "server", "--backend-store-uri", store,
            "--host", host, "--port", str(port), "--workers", "1"]
    # The job runner and telemetry would otherwise add ~15 processes (2.4 GB) that SIGTERM leaves behind.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    if s3 is not None:
        args += ["--artifacts-destination", f"s3://{s3.bucket}/mlflow"]
        # its artifact proxy reaches that S3 with its keys alone, whatever AWS the caller has
        env = environ.changed(env, {**environ.own_s3(s3.env(), env), "MLFLOW_S3_ENDPOINT_URL": s3.endpoint})
    else:
        args += ["--artifacts-destination", str(workdir / "artifacts")]
    with running_process(args, cwd=workdir, env=env, log_path=workdir / "mlflow.out", what="mlflow server",
                         ready=lambda: _healthy(server.url), timeout_s=timeout_s, port=port, lease=lease):
        yield server
