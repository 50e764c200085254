"""The checkpoint protocol of components.trainer.checkpoint (published folders plus the ``latest`` pointer),
against a real SeaweedFS (credentials enforced) and against local paths."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from storage_trees import read_tree, write_tree

from components import storage
from components.launch.process import free_ports
from components.trainer import checkpoint as ckpt
from pipeline.services.seaweed import SeaweedS3


@pytest.fixture(autouse=True)
def _s3(s3_env: SeaweedS3) -> SeaweedS3:
    """Every test here talks to the session's SeaweedFS (tests/integration/conftest.py)."""
    return s3_env


def make_checkpoint(base: Path, name: str, step: int) -> Path:
    return write_tree(base / name, {"lora.safetensors": os.urandom(50_000) + bytes([step]),
                                    "optimizer.pt": os.urandom(20_000), "state/trainer.json": b'{"step": %d}' % step})


def test_publish_and_newest_checkpoint(root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"{root}/checkpoints"
    assert ckpt.newest_checkpoint(prefix) is None
    assert ckpt.latest_checkpoint(root) is None

    one = make_checkpoint(tmp_path, "step-1", 1)
    assert ckpt.publish_checkpoint(one, prefix) == f"{prefix}/step-1"
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/step-1"
    two = make_checkpoint(tmp_path, "step-2", 2)
    ckpt.publish_checkpoint(two, prefix)
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/step-2"
    assert ckpt.latest_checkpoint(root) == f"{prefix}/step-2"  # a run's output: its checkpoints/ folder
    storage.download_dir(f"{prefix}/step-2", tmp_path / "restored")
    restored = read_tree(tmp_path / "restored")
    assert restored.pop(storage.MANIFEST_NAME)
    assert restored == read_tree(two)

    # Interrupt the next publish after its first file: the pointer must keep naming step-2.
    real_put_file, calls = storage._put_file, []

    def failing_put_file(src: Path, uri: str) -> None:
        calls.append(uri)
        if len(calls) == 2:
            raise ConnectionError("network went away mid-checkpoint")
        real_put_file(src, uri)

    with monkeypatch.context() as m, pytest.raises(ConnectionError):
        m.setattr(storage, "_put_file", failing_put_file)
        ckpt.publish_checkpoint(make_checkpoint(tmp_path, "step-3", 3), prefix)
    assert len(storage.list_uris(f"{prefix}/step-3")) == 1  # really half-uploaded
    assert storage.get_bytes(f"{prefix}/latest") == b"step-2"
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/step-2"

    # Files of step-3 uploaded by hand, without its manifest, do not make it a checkpoint either.
    storage.upload_dir(tmp_path / "step-3", f"{prefix}/step-3")
    storage.put_bytes(b"step-3", f"{prefix}/latest")  # even if a pointer names it
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/step-2"


def test_newest_falls_back_when_pointer_names_incomplete(root: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"{root}/ckpts"
    ckpt.publish_checkpoint(make_checkpoint(tmp_path, "a", 1), prefix)
    ckpt.publish_checkpoint(make_checkpoint(tmp_path, "b", 2), prefix)
    ckpt.publish_checkpoint(make_checkpoint(tmp_path, "c", 3), prefix)

    # A file of the pointed-to checkpoint disappears: the newest complete one (b) is returned instead.
    storage.delete(f"{prefix}/c/optimizer.pt")
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/b"

    # Re-publishing b is interrupted: its old manifest was withdrawn first, so b no longer counts.
    def broken_put_file(src: Path, uri: str) -> None:
        raise OSError("disk gone")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk gone"):
        m.setattr(storage, "_put_file", broken_put_file)
        ckpt.publish_checkpoint(tmp_path / "b", prefix)
    assert ckpt.newest_checkpoint(prefix) == f"{prefix}/a"

    storage.delete(f"{prefix}/a/{storage.MANIFEST_NAME}")
    assert ckpt.newest_checkpoint(prefix) is None


def test_publish_rejects_reserved_names(root: str, tmp_path: Path) -> None:
    with pytest.raises(ckpt.CheckpointPublishError, match="invalid checkpoint name"):
        ckpt.publish_checkpoint(make_checkpoint(tmp_path, ckpt.LATEST_NAME, 1), f"{root}/c")
    with pytest.raises(ckpt.CheckpointPublishError, match="not a directory"):
        ckpt.publish_checkpoint(tmp_path / "nope", f"{root}/c")
    reserved = make_checkpoint(tmp_path, "r", 1)
    (reserved / storage.MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(ckpt.CheckpointPublishError, match="reserved") as info:
        ckpt.publish_checkpoint(reserved, f"{root}/c")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert storage.list_uris(f"{root}/c") == []
    assert issubclass(ckpt.CheckpointPublishError, storage.StorageError)


def test_unreachable_endpoint(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("FLOWGRPO_S3_CONNECT_TIMEOUT_S", "2")
    start = time.monotonic()
    with pytest.raises(storage.EndpointUnreachableError, match=f"127.0.0.1:{port} is unreachable"):
        ckpt.newest_checkpoint(f"s3://{seaweed.bucket}/ck")
    assert time.monotonic() - start < 10
