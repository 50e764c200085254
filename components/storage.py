"""Object storage for every stage: ``s3://bucket/key`` URIs and local paths behind one small API.

This is the only module of the project that talks to S3. Endpoint, region and credentials come only from
the environment that boto3 reads itself (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), never from arguments, so an experiment
config can never carry a secret or redirect traffic. ``AWS_MAX_ATTEMPTS`` and
``FLOWGRPO_S3_CONNECT_TIMEOUT_S`` / ``FLOWGRPO_S3_READ_TIMEOUT_S`` tune retries and timeouts.

Local paths (plain or ``file://``) get the same semantics, so callers never branch on the scheme:
writes go to a temporary name and are renamed into place.

Every object written here carries its SHA-256 in the metadata key ``sha256``; downloads recompute it and
raise :class:`ChecksumMismatchError` on a difference. Objects written by other tools carry none and are
read unverified.

A finished folder is published whole or not at all (:func:`publish_folder`): its files first, then a
manifest of their sizes and SHA-256, which :func:`complete_manifest` checks on read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
import posixpath
import re
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from components import environ
from components.errors import FlowGRPOError

log = logging.getLogger(__name__)

# Files at least this large go up in parts (parallel, retried per part). Tests lower it to exercise multipart.
MULTIPART_THRESHOLD = 64 * 1024 * 1024
MULTIPART_CHUNKSIZE = 64 * 1024 * 1024
MAX_CONCURRENCY = 4
# Seconds between progress lines of one transfer; transfers shorter than this log no progress at INFO.
PROGRESS_INTERVAL_S = 10.0

SHA256_METADATA_KEY = "sha256"
MANIFEST_NAME = "_MANIFEST.json"  # written last into a published folder
_TMP_SUFFIX = ".flowgrpo-tmp"
_HASH_BLOCK = 8 * 1024 * 1024


class StorageError(FlowGRPOError):
    """An object-storage operation that failed; the message names the URI and, for S3, the endpoint."""


class ObjectNotFoundError(StorageError):
    """The object (or local file) does not exist."""


class BucketNotFoundError(StorageError):
    """The bucket does not exist."""


class StorageAuthError(StorageError):
    """Credentials are missing, wrong, or not allowed to do this."""


class EndpointUnreachableError(StorageError):
    """The S3 endpoint could not be reached (nothing listening, DNS, timeout)."""


class ChecksumMismatchError(StorageError):
    """Downloaded bytes do not match the SHA-256 recorded when the object was uploaded."""


class ObjectTooLargeError(StorageError):
    """The object is larger than its reader takes (found from its size, before its bytes are read)."""


class FolderPublishError(StorageError):
    """A folder cannot be published (bad name, not a directory, a reserved file name in it)."""


# --------------------------------------------------------------------------------------------- locations


@dataclass(frozen=True)
class _S3:
    bucket: str
    key: str

    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def _parse(uri: str | os.PathLike[str]) -> _S3 | Path:
    if isinstance(uri, os.PathLike):
        return Path(uri)
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://"):].partition("/")
        if not bucket:
            raise StorageError(f"no bucket in S3 URI {uri!r}")
        return _S3(bucket, key)
    if uri.startswith("file://"):
        return Path(unquote(urlsplit(uri).path))
    if is_uri(uri):
        raise StorageError(f"unsupported URI scheme in {uri!r}: use s3://bucket/key or a local path")
    return Path(uri)


def is_remote(uri: str | os.PathLike[str]) -> bool:
    """Whether ``uri`` names object storage rather than the local file system."""
    return isinstance(_parse(uri), _S3)


_URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_uri(text: str) -> bool:
    """Whether ``text`` is written as a URI (``scheme://...``, any scheme) rather than a plain path. Such text
    belongs to this module (e.g. :func:`local_copy`), which takes ``s3://`` and ``file://`` and rejects others."""
    return _URI_SCHEME.match(text) is not None


def join(prefix: str | os.PathLike[str], *parts: str) -> str:
    """``prefix/part/...`` in the caller's own notation (an s3:// URI, a file:// URI or a path)."""
    base = os.fspath(prefix).rstrip("/")
    return "/".join([base, *parts]) if base else "/".join(parts)


def _dir_key(key: str) -> str:
    # A prefix means a folder: "ckpt" must not match "ckpt2/...".
    return key if not key or key.endswith("/") else key + "/"


# --------------------------------------------------------------------------------------------- S3 client

_CLIENT_ENV = (environ.AWS_ENDPOINT_URL_S3, environ.AWS_ENDPOINT_URL, environ.AWS_ACCESS_KEY_ID,
               environ.AWS_SECRET_ACCESS_KEY, environ.AWS_SESSION_TOKEN, environ.AWS_REGION, environ.AWS_DEFAULT_REGION,
               environ.AWS_PROFILE, environ.AWS_MAX_ATTEMPTS, environ.FLOWGRPO_S3_CONNECT_TIMEOUT_S,
               environ.FLOWGRPO_S3_READ_TIMEOUT_S)


def _client() -> Any:
    # One client per distinct environment: tests (and long-lived processes) may change the variables.
    return _client_for(tuple(v.raw() for v in _CLIENT_ENV))


@functools.lru_cache(maxsize=8)
def _client_for(env: tuple[str | None, ...]) -> Any:
    """The client for ``env`` (the values of _CLIENT_ENV, which boto3 reads from the environment)."""
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},  # SeaweedFS / MinIO have no virtual-host buckets
        # total_max_attempts counts the first try, as AWS_MAX_ATTEMPTS does for every AWS tool (max_attempts would
        # count retries only: one try more than the variable says)
        retries={"mode": "standard", "total_max_attempts": environ.AWS_MAX_ATTEMPTS.value()},
        connect_timeout=environ.FLOWGRPO_S3_CONNECT_TIMEOUT_S.value(),
        read_timeout=environ.FLOWGRPO_S3_READ_TIMEOUT_S.value(),
    )
    # A fresh session so the variables are read now, not when boto3's default session was first made.
    return boto3.session.Session().client("s3", config=config)


def _endpoint(client: Any) -> str:
    parts = urlsplit(client.meta.endpoint_url)
    host = parts.netloc.rpartition("@")[2]  # never echo user:password embedded in an endpoint URL
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig

    # Read the module constants at call time so tests (and callers) can lower them.
    return TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_CHUNKSIZE,
                          max_concurrency=MAX_CONCURRENCY)


_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden",
               "InvalidToken", "ExpiredToken", "AuthorizationHeaderMalformed", "InvalidClientTokenId"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__, getattr(e, "last_exception", None)]


def _translate(exc: BaseException, uri: str, action: str, client: Any) -> StorageError:
    """Map a boto3/botocore error to one of ours. Messages are built here from the error code, the URI and
    the endpoint only, so no credential can leak into them."""
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
        ReadTimeoutError,
    )

    endpoint = _endpoint(client)
    where = f"{uri} (endpoint {endpoint})"
    for e in _causes(exc):
        if isinstance(e, ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            bucket = _parse(uri).bucket if uri.startswith("s3://") else "?"
            if code == "NoSuchBucket":
                return BucketNotFoundError(f"cannot {action} {where}: bucket {bucket!r} does not exist")
            if code in _AUTH_CODES or status == 403:
                return StorageAuthError(
                    f"cannot {action} {where}: access denied ({code or status}); check AWS_ACCESS_KEY_ID / "
                    f"AWS_SECRET_ACCESS_KEY and the permissions on bucket {bucket!r}")
            if code in _NOT_FOUND_CODES or status == 404:
                # HEAD answers a bare 404 for a missing bucket too; ask which one it is.
                if bucket != "?" and not _bucket_exists(client, bucket):
                    return BucketNotFoundError(f"cannot {action} {where}: bucket {bucket!r} does not exist")
                return ObjectNotFoundError(f"cannot {action} {where}: no such object")
            return StorageError(f"cannot {action} {where}: S3 error {code or status}")
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError, ConnectionClosedError)):
            return EndpointUnreachableError(f"cannot {action} {uri}: S3 endpoint {endpoint} is unreachable "
                                            f"({type(e).__name__}); check AWS_ENDPOINT_URL_S3")
        if isinstance(e, ReadTimeoutError):
            return EndpointUnreachableError(f"cannot {action} {where}: the endpoint stopped answering (read timeout)")
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return StorageAuthError(f"cannot {action} {where}: no S3 credentials; set AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY")
    return StorageError(f"cannot {action} {where}: {type(exc).__name__}")


def _bucket_exists(client: Any, bucket: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        return code not in {"404", "NoSuchBucket", "NotFound"}
    return True


@contextlib.contextmanager
def _s3_errors(uri: str, action: str) -> Iterator[Any]:
    """Yield the client; turn anything boto raises into a StorageError subclass."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    client = _client()
    try:
        yield client
    except (ClientError, BotoCoreError, Boto3Error) as exc:
        raise _translate(exc, uri, action, client) from exc


# --------------------------------------------------------------------------------------------- helpers


class _Progress:
    """A boto3 transfer callback that logs bytes done and rate every PROGRESS_INTERVAL_S seconds."""

    def __init__(self, verb: str, uri: str, total: int) -> None:
        self.verb, self.uri, self.total = verb, uri, total
        self.done = 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self.lock:  # s3transfer calls back from several threads
            self.done += n
            now = time.monotonic()
            if now - self.last >= PROGRESS_INTERVAL_S:
                self.last = now
                log.info("%s", self._line(now))

    def finish(self) -> None:
        now = time.monotonic()
        log.log(logging.INFO if now - self.start >= PROGRESS_INTERVAL_S else logging.DEBUG, "%s done", self._line(now))

    def _line(self, now: float) -> str:
        mib = 1024 * 1024
        rate = self.done / max(now - self.start, 1e-9) / mib
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.verb} {self.uri}: {self.done / mib:.1f}/{self.total / mib:.1f} MiB ({pct:.0f}%) "
                f"at {rate:.1f} MiB/s")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def _tmp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{_TMP_SUFFIX}")


@contextlib.contextmanager
def _atomic_local(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it into place, else remove it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_beside(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _safe_rel(rel: str, uri: str) -> str:
    # Keys come from a bucket someone else may write to: never let one escape the target directory.
    parts = PurePosixPath(rel).parts
    if not parts or rel.startswith("/") or any(p in ("..", ".") for p in parts):
        raise StorageError(f"refusing to download {uri}: key {rel!r} is not a plain relative path")
    return rel


def _local_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative posix path, path) of every regular file under ``root``, sorted, skipping our temp files."""
    if not root.is_dir():
        return
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(_TMP_SUFFIX)):
        yield path.relative_to(root).as_posix(), path


def _sizes(uri_prefix: str, limit: int | None = None) -> dict[str, int]:
    """Relative name -> size of every object under the folder ``uri_prefix`` (the first ``limit`` by name)."""
    loc = _parse(uri_prefix)
    if isinstance(loc, Path):
        return {rel: p.stat().st_size for rel, p in itertools.islice(_local_files(loc), limit)}
    prefix = _dir_key(loc.key)
    out: dict[str, int] = {}
    with _s3_errors(uri_prefix, "list") as client:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix,
                                                                 PaginationConfig={"MaxItems": limit})
        for page in pages:
            for obj in page.get("Contents", []):
                out[obj["Key"][len(prefix):]] = obj["Size"]
    return out


# --------------------------------------------------------------------------------------------- public API


def put_file(local_path: str | os.PathLike[str], uri: str) -> None:
    """Upload (or copy) one file to ``uri``, recording its SHA-256; large files go up in parts."""
    _put_file(Path(local_path), uri)


def _put_file(src: Path, uri: str) -> None:
    # The one per-file uploader every higher-level call goes through.
    if not src.is_file():
        raise ObjectNotFoundError(f"cannot upload {src} to {uri}: no such local file")
    loc = _parse(uri)
    if isinstance(loc, Path):
        with _atomic_local(loc) as tmp:
            shutil.copyfile(src, tmp)
        return
    digest = _sha256_file(src)
    progress = _Progress("upload", uri, src.stat().st_size)
    with _s3_errors(uri, "upload to") as client:
        client.upload_file(str(src), loc.bucket, loc.key, ExtraArgs={"Metadata": {SHA256_METADATA_KEY: digest}},
                           Config=_transfer_config(), Callback=progress)
    progress.finish()


def get_file(uri: str, local_path: str | os.PathLike[str]) -> None:
    """Download (or copy) ``uri`` to ``local_path``; the file appears only once its checksum matched."""
    dst = Path(local_path)
    loc = _parse(uri)
    if isinstance(loc, Path):
        if not loc.is_file():
            raise ObjectNotFoundError(f"cannot read {uri}: no such file")
        with _atomic_local(dst) as tmp:
            shutil.copyfile(loc, tmp)
        return
    with _s3_errors(uri, "read") as client:
        head = client.head_object(Bucket=loc.bucket, Key=loc.key)
        progress = _Progress("download", uri, head["ContentLength"])
        with _atomic_local(dst) as tmp:
            client.download_file(loc.bucket, loc.key, str(tmp), Config=_transfer_config(), Callback=progress)
            _verify(uri, head.get("Metadata", {}), _sha256_file(tmp))
    progress.finish()


def _verify(uri: str, metadata: dict[str, str], actual: str) -> None:
    expected = metadata.get(SHA256_METADATA_KEY)
    if expected is None:
        log.debug("%s carries no sha256 metadata; not verified", uri)
    elif expected != actual:
        raise ChecksumMismatchError(f"checksum mismatch for {uri}: stored sha256 {expected[:16]}..., "
                                    f"downloaded bytes have {actual[:16]}... (object changed or corrupted)")


def put_bytes(data: bytes, uri: str) -> None:
    """Write ``data`` to ``uri`` in one request (or atomically to a local file)."""
    loc = _parse(uri)
    if isinstance(loc, Path):
        with _atomic_local(loc) as tmp:
            tmp.write_bytes(data)
        return
    with _s3_errors(uri, "write") as client:
        client.put_object(Bucket=loc.bucket, Key=loc.key, Body=data,
                          Metadata={SHA256_METADATA_KEY: hashlib.sha256(data).hexdigest()})


def _too_large(uri: str, size: int, max_bytes: int) -> ObjectTooLargeError:
    return ObjectTooLargeError(f"{uri} is {size} bytes, over the limit of {max_bytes} bytes for what is read here")


def get_bytes(uri: str, max_bytes: int | None = None) -> bytes:
    """The whole content of ``uri``, checksum-verified. For small objects: it is read into memory. With
    ``max_bytes``, a larger object raises ObjectTooLargeError from its size, before its bytes are read (a local
    file that grows meanwhile is still read no further)."""
    loc = _parse(uri)
    if isinstance(loc, Path):
        try:
            with loc.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if max_bytes is not None and size > max_bytes:
                    raise _too_large(uri, size, max_bytes)
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFoundError(f"cannot read {uri}: no such file") from None
        if max_bytes is not None and len(data) > max_bytes:
            raise _too_large(uri, len(data), max_bytes)
        return data
    with _s3_errors(uri, "read") as client:
        response = client.get_object(Bucket=loc.bucket, Key=loc.key)
        if max_bytes is not None and response["ContentLength"] > max_bytes:
            response["Body"].close()
            raise _too_large(uri, response["ContentLength"], max_bytes)
        data = response["Body"].read()
    _verify(uri, response.get("Metadata", {}), hashlib.sha256(data).hexdigest())
    return data


def within(folder: str, rel: str) -> str | None:
    """``rel`` joined to ``folder`` when the result stays inside it, else None. A local path is compared with
    symbolic links resolved (the real path is returned: what was checked is what is read); an S3 key with its
    ``.`` and ``..`` segments folded, as a server that normalises the request path would fold them."""
    loc = _parse(folder)
    if isinstance(loc, Path):
        root = os.path.realpath(loc)
        target = os.path.realpath(loc / rel)
        return target if target.startswith(root.rstrip(os.sep) + os.sep) else None
    key = posixpath.normpath(rel)
    if rel.startswith("/") or key in (".", "..") or key.startswith("../"):
        return None
    return f"s3://{loc.bucket}/{_dir_key(loc.key)}{key}"


def exists(uri: str) -> bool:
    """Whether the object (local file) ``uri`` exists. A missing bucket is an error, not False."""
    loc = _parse(uri)
    if isinstance(loc, Path):
        return loc.is_file()
    try:
        with _s3_errors(uri, "check") as client:
            client.head_object(Bucket=loc.bucket, Key=loc.key)
    except ObjectNotFoundError:
        return False
    return True


def list_uris(uri_prefix: str, limit: int | None = None) -> list[str]:
    """Sorted URIs (in the caller's notation) of every object under the folder ``uri_prefix``; with ``limit``, of
    the first that many."""
    return [join(uri_prefix, rel) for rel in sorted(_sizes(uri_prefix, limit))]


def upload_dir(local_dir: str | os.PathLike[str], uri_prefix: str) -> list[str]:
    """Upload every file under ``local_dir`` to ``uri_prefix/<relative path>``; returns the URIs written."""
    root = Path(local_dir)
    if not root.is_dir():
        raise ObjectNotFoundError(f"cannot upload {root} to {uri_prefix}: no such local directory")
    written = []
    for rel, path in _local_files(root):
        _put_file(path, join(uri_prefix, rel))
        written.append(join(uri_prefix, rel))
    return written


def download_dir(uri_prefix: str, local_dir: str | os.PathLike[str]) -> list[Path]:
    """Download every object under the folder ``uri_prefix`` into ``local_dir``; returns the files written."""
    root = Path(local_dir)
    written = []
    for rel in sorted(_sizes(uri_prefix)):
        get_file(join(uri_prefix, rel), root / _safe_rel(rel, join(uri_prefix, rel)))
        written.append(root / rel)
    return written


def cache_root() -> Path:
    """This machine's (pod's) folder for copies and staging: ``$FLOWGRPO_CACHE_DIR``, default ``~/.cache/flowgrpo``."""
    return environ.FLOWGRPO_CACHE_DIR.value()


def local_copy(uri: str) -> Path:
    """A local path with what ``uri`` names, for loaders that read files (model weights, pipelines).

    A local path is returned as it is. An ``s3://`` object or folder is downloaded once, checksums
    verified, into ``$FLOWGRPO_CACHE_DIR`` (default ``~/.cache/flowgrpo``) under a name derived from the
    URI, and reused afterwards. It appears there only when complete (downloaded beside it, then renamed),
    so concurrent processes never read a partial copy.
    """
    loc = _parse(uri)
    if isinstance(loc, Path):
        return loc
    objects = cache_root() / "objects"
    final = objects / hashlib.sha256(uri.encode()).hexdigest()[:32]
    name = PurePosixPath(loc.key.rstrip("/")).name or loc.bucket
    if final.exists():
        return final / name
    staging = objects / f"{final.name}{_TMP_SUFFIX}-{secrets.token_hex(4)}"
    try:
        if exists(uri):
            get_file(uri, staging / name)
        elif not download_dir(uri, staging / name):
            raise ObjectNotFoundError(f"{uri}: no object or folder of objects there")
        with contextlib.suppress(OSError):  # another process published the same copy first: use that one
            os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final / name


def delete_prefix(uri_prefix: str) -> int:
    """Delete every object under the folder ``uri_prefix``; returns how many were deleted."""
    loc = _parse(uri_prefix)
    if isinstance(loc, Path):
        files = list(_local_files(loc))
        if loc.is_dir():
            shutil.rmtree(loc)
        return len(files)
    keys = [_dir_key(loc.key) + rel for rel in _sizes(uri_prefix)]
    with _s3_errors(uri_prefix, "delete") as client:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[i:i + 1000]
            response = client.delete_objects(Bucket=loc.bucket,
                                              Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"cannot delete under {uri_prefix}: {len(response['Errors'])} objects failed, "
                                   f"first {first.get('Key')!r}: {first.get('Code')}")
    return len(keys)


def delete(uri: str) -> None:
    """Delete one object (local file); a missing one is not an error."""
    loc = _parse(uri)
    if isinstance(loc, Path):
        loc.unlink(missing_ok=True)
        return
    with _s3_errors(uri, "delete") as client:
        client.delete_object(Bucket=loc.bucket, Key=loc.key)


# --------------------------------------------------------------------------------------------- published folders


def publish_folder(local_dir: str | os.PathLike[str], uri_prefix: str, name: str | None = None) -> str:
    """Upload the finished folder ``local_dir`` to ``uri_prefix/<name>/`` (name defaults to the directory's
    name) so that readers see it whole or not at all: its files first, then ``MANIFEST_NAME`` listing each
    file's size and SHA-256, written last (:func:`complete_manifest` checks it). Publishing over an existing
    folder withdraws its manifest before anything else. Returns the folder's URI."""
    root = Path(local_dir)
    name = name or root.name
    if not root.is_dir():
        raise FolderPublishError(f"cannot publish {root}: not a directory")
    if not name or "/" in name or name in (".", ".."):
        raise FolderPublishError(f"cannot publish {root}: invalid folder name {name!r}")
    files = {rel: path for rel, path in _local_files(root)}
    if MANIFEST_NAME in files:
        raise FolderPublishError(f"cannot publish {root}: it contains a file named {MANIFEST_NAME} (reserved)")
    target = join(uri_prefix, name)
    # Re-publishing a name: drop its old manifest first so a half-overwritten copy never looks complete.
    delete(join(target, MANIFEST_NAME))
    manifest = {"name": name, "published_at": time.time(), "files": {}}
    for rel, path in files.items():
        manifest["files"][rel] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
        _put_file(path, join(target, rel))
    put_bytes(json.dumps(manifest, indent=1, sort_keys=True).encode(), join(target, MANIFEST_NAME))
    log.info("published %s (%d files)", target, len(files))
    return target


def complete_manifest(uri: str) -> dict | None:
    """The manifest of the folder published at ``uri`` (its ``name``, ``published_at`` and ``files``) when
    every file it lists is present with its recorded size; None when it has no readable manifest or is
    incomplete."""
    try:
        manifest = json.loads(get_bytes(join(uri, MANIFEST_NAME)))
    except (ObjectNotFoundError, ChecksumMismatchError, ValueError):
        return None
    present = _sizes(uri)
    files = manifest.get("files", {}) if isinstance(manifest, dict) else {}
    if all(present.get(rel) == meta.get("size") for rel, meta in files.items()):
        return manifest
    log.warning("%s is incomplete: files listed in its manifest are missing or truncated", uri)
    return None


def published_folders(uri_prefix: str) -> set[str]:
    """Names of the folders directly under ``uri_prefix`` that carry a manifest, complete or not (one
    listing; check each with :func:`complete_manifest`)."""
    return {rel[: -len(MANIFEST_NAME) - 1] for rel in _sizes(uri_prefix)
            if rel.endswith("/" + MANIFEST_NAME) and rel.count("/") == 1}
