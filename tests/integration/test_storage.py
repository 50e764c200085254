"""components.storage against a real SeaweedFS (credentials enforced) and against local paths."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import traceback
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from components import storage
from components.errors import FlowGRPOError
from components.launch.process import free_ports
from pipeline.services.seaweed import SeaweedS3

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _s3(s3_env: SeaweedS3) -> SeaweedS3:
    """Every test here talks to the session's SeaweedFS (tests/integration/conftest.py)."""
    return s3_env


@pytest.fixture
def raw(seaweed: SeaweedS3):
    """A plain boto3 client, to look at or tamper with objects behind the API's back."""
    return boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=seaweed.access_key,
                        aws_secret_access_key=seaweed.secret_key, region_name=seaweed.region,
                        config=Config(s3={"addressing_style": "path"}))


@pytest.fixture(params=["s3", "path", "file-uri"])
def root(request: pytest.FixtureRequest, seaweed: SeaweedS3, tmp_path: Path) -> str:
    """A fresh folder in each notation the API accepts."""
    if request.param == "s3":
        return f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:10]}"
    if request.param == "path":
        return str(tmp_path / "store")
    return (tmp_path / "store").as_uri()


def write_tree(base: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    return base


def read_tree(base: Path) -> dict[str, bytes]:
    return {p.relative_to(base).as_posix(): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}


def test_bytes_round_trip(root: str) -> None:
    uri = f"{root}/a/b.bin"
    assert not storage.exists(uri)
    storage.put_bytes(b"\x00first", uri)
    assert storage.exists(uri)
    assert storage.get_bytes(uri) == b"\x00first"
    storage.put_bytes(b"", uri)  # overwrite, with an empty object
    assert storage.get_bytes(uri) == b""
    assert not storage.exists(f"{root}/a")  # a folder is not an object


def test_file_and_dir_round_trip(root: str, tmp_path: Path) -> None:
    files = {"model.safetensors": os.urandom(300_000), "sub/dir/config.json": b'{"a": 1}', "empty": b""}
    src = write_tree(tmp_path / "src", files)
    storage.put_bytes(b"x", f"{root}/ckpt2/other")  # shares the string prefix "ckpt", not the folder

    written = storage.upload_dir(src, f"{root}/ckpt")
    expected = [f"{root}/ckpt/{rel}" for rel in sorted(files)]
    assert written == expected
    assert storage.list(f"{root}/ckpt") == expected
    assert storage.list(f"{root}/ckpt/") == expected
    assert storage.list(f"{root}/nothing-here") == []

    storage.download_dir(f"{root}/ckpt", tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == files

    storage.get_file(f"{root}/ckpt/sub/dir/config.json", tmp_path / "one" / "c.json")
    assert (tmp_path / "one" / "c.json").read_bytes() == b'{"a": 1}'
    storage.put_file(tmp_path / "one" / "c.json", f"{root}/single.json")
    assert storage.get_bytes(f"{root}/single.json") == b'{"a": 1}'

    assert storage.delete_prefix(f"{root}/ckpt") == 3
    assert storage.list(f"{root}/ckpt") == []
    assert storage.get_bytes(f"{root}/ckpt2/other") == b"x"


def test_missing_object(root: str, tmp_path: Path) -> None:
    uri = f"{root}/missing.bin"
    with pytest.raises(storage.ObjectNotFoundError, match=r"missing\.bin"):
        storage.get_bytes(uri)
    with pytest.raises(storage.ObjectNotFoundError, match=r"missing\.bin"):
        storage.get_file(uri, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    with pytest.raises(storage.ObjectNotFoundError, match="no-such-file"):
        storage.put_file(tmp_path / "no-such-file", f"{root}/x")


def test_multipart_upload_and_progress(seaweed: SeaweedS3, raw, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(storage, "MULTIPART_THRESHOLD", 5 * MiB)
    monkeypatch.setattr(storage, "MULTIPART_CHUNKSIZE", 5 * MiB)  # S3's smallest part size
    monkeypatch.setattr(storage, "PROGRESS_INTERVAL_S", 0.0)
    data = os.urandom(12 * MiB)
    (tmp_path / "big.bin").write_bytes(data)
    key = f"t-{uuid.uuid4().hex[:10]}/big.bin"
    uri = f"s3://{seaweed.bucket}/{key}"

    with caplog.at_level(logging.INFO, logger="components.storage"):
        storage.put_file(tmp_path / "big.bin", uri)
    head = raw.head_object(Bucket=seaweed.bucket, Key=key)
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag: 12 MiB in 5 MiB parts
    assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert any("upload" in r.getMessage() and "MiB/s" in r.getMessage() for r in caplog.records)

    storage.get_file(uri, tmp_path / "back.bin")
    assert hashlib.sha256((tmp_path / "back.bin").read_bytes()).digest() == hashlib.sha256(data).digest()

    # Below the threshold the same call makes a single-request upload.
    (tmp_path / "small.bin").write_bytes(data[: 4 * MiB])
    storage.put_file(tmp_path / "small.bin", uri + ".small")
    assert "-" not in raw.head_object(Bucket=seaweed.bucket, Key=key + ".small")["ETag"]


def test_checksum_mismatch_detected(seaweed: SeaweedS3, raw, tmp_path: Path) -> None:
    key = f"t-{uuid.uuid4().hex[:10]}/weights.bin"
    uri = f"s3://{seaweed.bucket}/{key}"
    storage.put_bytes(b"good bytes", uri)
    assert storage.get_bytes(uri) == b"good bytes"
    old = raw.head_object(Bucket=seaweed.bucket, Key=key)["Metadata"]
    raw.put_object(Bucket=seaweed.bucket, Key=key, Body=b"evil bytes", Metadata=old)  # same size, stale sha256

    with pytest.raises(storage.ChecksumMismatchError, match=f"checksum mismatch for {uri}"):
        storage.get_bytes(uri)
    with pytest.raises(storage.ChecksumMismatchError):
        storage.get_file(uri, tmp_path / "weights.bin")
    assert not (tmp_path / "weights.bin").exists()  # a corrupt download never lands
    assert list(tmp_path.iterdir()) == []  # nor does its temporary file


def make_checkpoint(base: Path, name: str, step: int) -> Path:
    return write_tree(base / name, {"lora.safetensors": os.urandom(50_000) + bytes([step]),
                                    "optimizer.pt": os.urandom(20_000), "state/trainer.json": b'{"step": %d}' % step})


def test_publish_and_latest_checkpoint(root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"{root}/checkpoints"
    assert storage.latest_checkpoint(prefix) is None

    one = make_checkpoint(tmp_path, "step-1", 1)
    assert storage.publish_checkpoint(one, prefix) == f"{prefix}/step-1"
    assert storage.latest_checkpoint(prefix) == f"{prefix}/step-1"
    two = make_checkpoint(tmp_path, "step-2", 2)
    storage.publish_checkpoint(two, prefix)
    assert storage.latest_checkpoint(prefix) == f"{prefix}/step-2"
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
        storage.publish_checkpoint(make_checkpoint(tmp_path, "step-3", 3), prefix)
    assert len(storage.list(f"{prefix}/step-3")) == 1  # really half-uploaded
    assert storage.get_bytes(f"{prefix}/latest") == b"step-2"
    assert storage.latest_checkpoint(prefix) == f"{prefix}/step-2"

    # Files of step-3 uploaded by hand, without its manifest, do not make it a checkpoint either.
    storage.upload_dir(tmp_path / "step-3", f"{prefix}/step-3")
    storage.put_bytes(b"step-3", f"{prefix}/latest")  # even if a pointer names it
    assert storage.latest_checkpoint(prefix) == f"{prefix}/step-2"


def test_latest_falls_back_when_pointer_names_incomplete(root: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"{root}/ckpts"
    storage.publish_checkpoint(make_checkpoint(tmp_path, "a", 1), prefix)
    storage.publish_checkpoint(make_checkpoint(tmp_path, "b", 2), prefix)
    storage.publish_checkpoint(make_checkpoint(tmp_path, "c", 3), prefix)

    # A file of the pointed-to checkpoint disappears: the newest complete one (b) is returned instead.
    storage.delete(f"{prefix}/c/optimizer.pt")
    assert storage.latest_checkpoint(prefix) == f"{prefix}/b"

    # Re-publishing b is interrupted: its old manifest was withdrawn first, so b no longer counts.
    def broken_put_file(src: Path, uri: str) -> None:
        raise OSError("disk gone")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk gone"):
        m.setattr(storage, "_put_file", broken_put_file)
        storage.publish_checkpoint(tmp_path / "b", prefix)
    assert storage.latest_checkpoint(prefix) == f"{prefix}/a"

    storage.delete(f"{prefix}/a/{storage.MANIFEST_NAME}")
    assert storage.latest_checkpoint(prefix) is None


def test_publish_rejects_reserved_names(root: str, tmp_path: Path) -> None:
    with pytest.raises(storage.CheckpointPublishError, match="invalid checkpoint name"):
        storage.publish_checkpoint(make_checkpoint(tmp_path, "latest", 1), f"{root}/c")
    with pytest.raises(storage.CheckpointPublishError, match="not a directory"):
        storage.publish_checkpoint(tmp_path / "nope", f"{root}/c")
    assert storage.list(f"{root}/c") == []


def assert_no_secret(exc: BaseException, *secrets: str) -> None:
    text = str(exc)
    full = "".join(traceback.format_exception(exc))  # the chained boto errors too
    for secret in secrets:
        assert secret not in text
        assert secret not in full
    assert "\n" not in text


def test_wrong_credentials(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:10]}/x.bin"
    storage.put_bytes(b"data", uri)

    wrong_secret = "WRONGSECRET" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong_secret)
    for call in (lambda: storage.get_bytes(uri), lambda: storage.put_bytes(b"x", uri), lambda: storage.exists(uri),
                 lambda: storage.list(uri.rsplit("/", 1)[0])):
        with pytest.raises(storage.StorageAuthError) as info:
            call()
        assert seaweed.bucket in str(info.value)
        assert seaweed.endpoint in str(info.value)
        assert_no_secret(info.value, wrong_secret, seaweed.access_key, seaweed.secret_key)

    wrong_key = "AKWRONG" + uuid.uuid4().hex[:12].upper()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", wrong_key)
    with pytest.raises(storage.StorageAuthError, match="access denied") as info:
        storage.get_bytes(uri)
    assert_no_secret(info.value, wrong_secret, wrong_key)
    assert isinstance(info.value, FlowGRPOError)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    assert storage.get_bytes(uri) == b"data"  # the client follows the environment back


def test_missing_bucket(seaweed: SeaweedS3, tmp_path: Path) -> None:
    bucket = "no-such-bucket-" + uuid.uuid4().hex[:8]
    uri = f"s3://{bucket}/k/x.bin"
    (tmp_path / "f").write_bytes(b"1")
    for call in (lambda: storage.get_bytes(uri), lambda: storage.put_bytes(b"x", uri), lambda: storage.exists(uri),
                 lambda: storage.list(f"s3://{bucket}/k"), lambda: storage.put_file(tmp_path / "f", uri),
                 lambda: storage.get_file(uri, tmp_path / "g")):
        with pytest.raises(storage.BucketNotFoundError, match=f"bucket '{bucket}' does not exist") as info:
            call()
        assert_no_secret(info.value, seaweed.access_key, seaweed.secret_key)


def test_unreachable_endpoint(seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (port,) = free_ports(1)  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    monkeypatch.setenv("FLOWGRPO_S3_CONNECT_TIMEOUT_S", "2")
    uri = f"s3://{seaweed.bucket}/x.bin"
    (tmp_path / "f").write_bytes(b"1")
    for call in (lambda: storage.get_bytes(uri), lambda: storage.put_file(tmp_path / "f", uri),
                 lambda: storage.latest_checkpoint(f"s3://{seaweed.bucket}/ck")):
        start = time.monotonic()
        with pytest.raises(storage.EndpointUnreachableError, match=f"127.0.0.1:{port} is unreachable") as info:
            call()
        assert time.monotonic() - start < 10
        assert_no_secret(info.value, seaweed.access_key, seaweed.secret_key)


def test_unsupported_scheme() -> None:
    with pytest.raises(storage.StorageError, match="unsupported URI scheme"):
        storage.get_bytes("gs://bucket/key")
