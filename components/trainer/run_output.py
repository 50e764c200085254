"""Where a training run's files go: a local directory, or an ``s3://`` prefix mirrored from local staging.

The trainer always writes into :attr:`RunOutput.local`; for a remote output each finished file is then
uploaded to the same relative name under :attr:`RunOutput.uri`, so the layout is the same in both places:
``config.yaml``, ``metrics.jsonl``, ``samples/``, ``checkpoints/``, ``lora/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from components import storage

# What a run writes under its output (also read by the pipeline steps, which must not import torch).
FINAL_LORA_DIR = "lora"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"


def _staging_root() -> Path:
    return Path(os.environ.get(storage.CACHE_ENV) or Path.home() / ".cache" / "flowgrpo") / "runs"


class RunOutput:
    def __init__(self, uri: str | os.PathLike[str]) -> None:
        self.uri = os.fspath(uri)
        self.remote = storage.is_remote(self.uri)
        if self.remote:
            self.local = _staging_root() / hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        else:
            self.local = Path(self.uri)
        # Checkpoints are assembled here before they are published under uri/checkpoints.
        self.scratch = self.local / ".staging"

    def __str__(self) -> str:
        return self.uri

    def prepare(self, fresh: bool) -> None:
        """Create the local directory; a fresh remote run starts from an empty staging copy."""
        if fresh and self.remote:
            shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True, exist_ok=True)

    def uri_of(self, rel: str) -> str:
        return storage.join(self.uri, rel)

    def publish(self, rel: str) -> None:
        """Upload the local file ``rel`` to the output (nothing to do for a local output)."""
        if self.remote:
            storage.put_file(self.local / rel, self.uri_of(rel))

    def publish_dir(self, rel: str) -> None:
        if self.remote:
            storage.upload_dir(self.local / rel, self.uri_of(rel))

    def fetch(self, rel: str) -> bool:
        """Bring the output's copy of ``rel`` into the local directory; whether the file is there now."""
        if self.remote:
            if not storage.exists(self.uri_of(rel)):
                (self.local / rel).unlink(missing_ok=True)
                return False
            storage.get_file(self.uri_of(rel), self.local / rel)
        return (self.local / rel).is_file()
