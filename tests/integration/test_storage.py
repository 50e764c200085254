"""components.storage against a real SeaweedFS (credentials enforced) and against local paths."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import traceback
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from storage_trees import read_tree, write_tree

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


def test_bytes_round_trip(root: str) -> None:
    uri = f"{root}/a/b.bin"
    assert not storage.exists(uri)
    storage.put_bytes(b"\x00first", uri)
    assert storage.exists(uri)
    assert storage.get_bytes(uri) == b"\x00first"
    storage.put_bytes(b"", uri)  # overwrite, with an empty object
    assert storage.get_bytes(uri) == b""
    assert not storage.exists(f"{root}/a")  # a folder is not an object


def test_get_bytes_refuses_an_object_over_its_limit_from_its_size(root: str) -> None:
    uri = f"{root}/a/image.png"
    storage.put_bytes(b"x" * 100, uri)
    assert storage.get_bytes(uri, max_bytes=100) == b"x" * 100
    with pytest.raises(storage.ObjectTooLargeError, match=r"image\.png is 100 bytes, over the limit of 99 bytes"):
        storage.get_bytes(uri, max_bytes=99)


def test_within_keeps_a_relative_name_inside_its_folder(root: str, tmp_path: Path) -> None:
    folder = f"{root}/set"
    storage.put_bytes(b"x", f"{folder}/img/a.png")
    inside = storage.within(folder, "img/./b/../a.png")
    assert inside is not None and storage.get_bytes(inside) == b"x"
    for rel in ("../a.png", "img/../../a.png", "/img/a.png", ".."):
        assert storage.within(folder, rel) is None, rel


def test_file_and_dir_round_trip(root: str, tmp_path: Path) -> None:
    files = {"model.safetensors": os.urandom(300_000), "sub/dir/config.json": b'{"a": 1}', "empty": b""}
    src = write_tree(tmp_path / "src", files)
    storage.put_bytes(b"x", f"{root}/ckpt2/other")  # shares the string prefix "ckpt", not the folder

    written = storage.upload_dir(src, f"{root}/ckpt")
    expected = [f"{root}/ckpt/{rel}" for rel in sorted(files)]
    assert written == expected
    assert storage.list_uris(f"{root}/ckpt") == expected
    assert storage.list_uris(f"{root}/ckpt/") == expected
    assert storage.list_uris(f"{root}/nothing-here") == []

    storage.download_dir(f"{root}/ckpt", tmp_path / "dst")
    assert read_tree(tmp_path / "dst") == files

    storage.get_file(f"{root}/ckpt/sub/dir/config.json", tmp_path / "one" / "c.json")
    assert (tmp_path / "one" / "c.json").read_bytes() == b'{"a": 1}'
    storage.put_file(tmp_path / "one" / "c.json", f"{root}/single.json")
    assert storage.get_bytes(f"{root}/single.json") == b'{"a": 1}'

    assert storage.delete_prefix(f"{root}/ckpt") == 3
    assert storage.list_uris(f"{root}/ckpt") == []
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


def make_folder(base: Path, name: str, step: int) -> Path:
    return write_tree(base / name, {"lora.safetensors": os.urandom(50_000) + bytes([step]),
                                    "optimizer.pt": os.urandom(20_000), "state/trainer.json": b'{"step": %d}' % step})


def test_publish_folder_is_seen_complete_or_not_at_all(root: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = f"{root}/published"
    assert storage.published_folders(prefix) == set()
    assert storage.complete_manifest(f"{prefix}/one") is None

    one = make_folder(tmp_path, "one", 1)
    assert storage.publish_folder(one, prefix) == f"{prefix}/one"
    manifest = storage.complete_manifest(f"{prefix}/one")
    assert manifest is not None and manifest["name"] == "one"
    assert manifest["files"] == {rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                                 for rel, data in read_tree(one).items()}
    assert storage.published_folders(prefix) == {"one"}
    storage.download_dir(f"{prefix}/one", tmp_path / "restored")
    restored = read_tree(tmp_path / "restored")
    # the manifest's bytes, as every earlier release wrote them (a published folder must stay readable)
    assert restored.pop(storage.MANIFEST_NAME) == json.dumps(manifest, indent=1, sort_keys=True).encode()
    assert restored == read_tree(one)
    assert storage.publish_folder(one, prefix, "renamed") == f"{prefix}/renamed"
    assert storage.complete_manifest(f"{prefix}/renamed")["name"] == "renamed"

    # Interrupt the next publish after its first file: the folder is not complete.
    real_put_file, calls = storage._put_file, []

    def failing_put_file(src: Path, uri: str) -> None:
        calls.append(uri)
        if len(calls) == 2:
            raise ConnectionError("network went away mid-upload")
        real_put_file(src, uri)

    with monkeypatch.context() as m, pytest.raises(ConnectionError):
        m.setattr(storage, "_put_file", failing_put_file)
        storage.publish_folder(make_folder(tmp_path, "two", 2), prefix)
    assert len(storage.list_uris(f"{prefix}/two")) == 1  # really half-uploaded
    assert storage.complete_manifest(f"{prefix}/two") is None
    # Its files uploaded by hand, without a manifest, do not publish it either.
    storage.upload_dir(tmp_path / "two", f"{prefix}/two")
    assert storage.complete_manifest(f"{prefix}/two") is None
    assert storage.published_folders(prefix) == {"one", "renamed"}

    # A file listed in the manifest disappears, or is truncated: the folder is no longer complete.
    storage.delete(f"{prefix}/one/optimizer.pt")
    assert storage.complete_manifest(f"{prefix}/one") is None
    storage.put_bytes(b"short", f"{prefix}/renamed/optimizer.pt")
    assert storage.complete_manifest(f"{prefix}/renamed") is None
    assert storage.published_folders(prefix) == {"one", "renamed"}  # they still carry their manifests

    # Re-publishing a complete folder is interrupted: its old manifest was withdrawn first.
    three = make_folder(tmp_path, "three", 3)
    storage.publish_folder(three, prefix)
    assert storage.complete_manifest(f"{prefix}/three") is not None

    def broken_put_file(src: Path, uri: str) -> None:
        raise OSError("disk gone")

    with monkeypatch.context() as m, pytest.raises(OSError, match="disk gone"):
        m.setattr(storage, "_put_file", broken_put_file)
        storage.publish_folder(three, prefix)
    assert storage.complete_manifest(f"{prefix}/three") is None
    assert "three" not in storage.published_folders(prefix)


def test_publish_folder_rejects_bad_input(root: str, tmp_path: Path) -> None:
    with pytest.raises(storage.FolderPublishError, match="not a directory"):
        storage.publish_folder(tmp_path / "nope", f"{root}/c")
    folder = make_folder(tmp_path, "f", 1)
    for name in (".", "..", "a/b"):
        with pytest.raises(storage.FolderPublishError, match="invalid folder name"):
            storage.publish_folder(folder, f"{root}/c", name)
    (folder / storage.MANIFEST_NAME).write_bytes(b"{}")
    with pytest.raises(storage.FolderPublishError, match=f"{storage.MANIFEST_NAME} \\(reserved\\)"):
        storage.publish_folder(folder, f"{root}/c")
    assert storage.list_uris(f"{root}/c") == []
    assert issubclass(storage.FolderPublishError, storage.StorageError)


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
                 lambda: storage.list_uris(uri.rsplit("/", 1)[0])):
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
                 lambda: storage.list_uris(f"s3://{bucket}/k"), lambda: storage.put_file(tmp_path / "f", uri),
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
                 lambda: storage.complete_manifest(f"s3://{seaweed.bucket}/ck"),
                 lambda: storage.published_folders(f"s3://{seaweed.bucket}/ck")):
        start = time.monotonic()
        with pytest.raises(storage.EndpointUnreachableError, match=f"127.0.0.1:{port} is unreachable") as info:
            call()
        assert time.monotonic() - start < 10
        assert_no_secret(info.value, seaweed.access_key, seaweed.secret_key)


def test_unsupported_scheme() -> None:
    with pytest.raises(storage.StorageError, match="unsupported URI scheme"):
        storage.get_bytes("gs://bucket/key")
