"""``S3Client``: one bucket prefix through s3fs, the requests the backend, its writer, its
reader and the resume of an upload all send.

The backend's operations, the writer's multipart upload and the reader's ranged GETs build
on this alone, so none of them imports another (docs/design.md: no import cycle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, BinaryIO, TypeVar
from urllib.parse import urlparse

import s3fs

from tierstore.errors import ConfigError, StorageError, UnsafePath
from tierstore.retry import RetryPolicy
from tierstore.storage.backend import check_key
from tierstore_s3 import _checksum
from tierstore_s3._errors import client_error_code, translate

__all__ = ["S3Client", "make_fs", "split_url"]

T = TypeVar("T")

# tierstore.retry is the one retry policy (docs/design.md, Conventions): botocore and s3fs must not retry
# underneath it, or a conditional PUT could be resent without us knowing (design.md invariant 12).
_NO_CLIENT_RETRIES = {"mode": "standard", "total_max_attempts": 1}


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` as bucket and prefix; a URL with credentials is refused."""
    parsed = urlparse(url)
    if "@" in parsed.netloc:  # never echo it: the part before "@" may be a secret
        raise ConfigError(
            "credentials do not belong in an S3 tier URL: pass key=/secret= or use the AWS credential chain"
        )
    if parsed.scheme != "s3" or not parsed.netloc or parsed.query or parsed.fragment:
        raise ConfigError(f"not an S3 tier URL (s3://bucket[/prefix]): {url!r}")
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except UnsafePath as err:
            raise ConfigError(f"unsafe prefix in S3 tier URL {url!r}") from err
    return parsed.netloc, prefix


def make_fs(
    endpoint_url: str | None,
    key: str | None,
    secret: str | None,
    token: str | None,
    profile: str | None,
    region: str | None,
    extra: Mapping[str, Any],
) -> s3fs.S3FileSystem:
    """An s3fs filesystem: explicit settings where given, else the standard AWS chain."""
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    options.update(extra)
    explicit = {
        "endpoint_url": endpoint_url,
        "key": key,
        "secret": secret,
        "token": token,
        "profile": profile,
    }
    options.update({name: value for name, value in explicit.items() if value is not None})
    if region is not None:
        options["client_kwargs"] = {**options.get("client_kwargs", {}), "region_name": region}
    options["config_kwargs"] = {**options.get("config_kwargs", {}), "retries": _NO_CLIENT_RETRIES}
    fs = s3fs.S3FileSystem(**options)
    fs.retries = 1  # s3fs's own retry loop: one attempt
    # Build the client now, not inside the first write: a bad profile or region fails
    # here, and a stream's memory is not charged with loading botocore's models.
    fs.connect()
    _require_parameters(fs)
    return fs


# s3fs silently drops request parameters its botocore does not know: an old botocore would
# turn the exclusive publish into a plain overwrite. Refuse to run on one.
_REQUIRED = {
    "PutObject": ("IfNoneMatch", "ChecksumCRC32C"),
    "CreateMultipartUpload": ("ChecksumType",),
    "CompleteMultipartUpload": ("ChecksumType", "ChecksumCRC32C"),
}


def _require_parameters(fs: s3fs.S3FileSystem) -> None:
    model = fs.s3.meta.service_model
    for operation, names in _REQUIRED.items():
        known = model.operation_model(operation).input_shape.members
        missing = [name for name in names if name not in known]
        if missing:
            raise ConfigError(
                f"this botocore's S3 {operation} lacks {missing}: upgrade "
                "s3fs/aiobotocore to a 2025 or later botocore"
            )


class S3Client:
    """Requests about keys under ``bucket/prefix`` of the tier ``label``, through ``fs``:
    each translated into tierstore's errors, each retried unit run under ``retry``."""

    def __init__(
        self,
        fs: s3fs.S3FileSystem,
        bucket: str,
        prefix: str,
        label: str,
        *,
        part_size: int,
        max_concurrency: int,
        full_object_checksum: bool,
        retry: RetryPolicy,
    ) -> None:
        self.fs = fs
        self.bucket = bucket
        self.prefix = prefix
        self.label = label
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.full_object_checksum = full_object_checksum
        self.retry = retry

    def full_key(self, key: str) -> str:
        check_key(key, tier=self.label)
        return f"{self.prefix}/{key}" if self.prefix else key

    def call(self, method: str, key: str, **params: Any) -> Any:
        """One S3 request about ``key``; failures come out as tierstore errors."""
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **params)
        except Exception as err:
            failure = translate(err, key=key, tier=self.label)
            if failure is err:
                raise
            raise failure from err

    def retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run the idempotent unit ``fn`` under the retry policy."""
        return self.retry.call(fn, what=f"S3 {what} of {key!r} in {self.label}")

    def head(self, key: str) -> dict[str, Any]:
        full = self.full_key(key)
        answer: dict[str, Any] = self.retrying(
            "head", key, lambda: self.call("head_object", key, Key=full, ChecksumMode="ENABLED")
        )
        return answer

    def put(self, key: str, body: bytes | BinaryIO, crc: int, **conditions: Any) -> Any:
        """One PutObject (not retried here) carrying our CRC32C for S3 to check."""
        return self.call(
            "put_object",
            key,
            Key=self.full_key(key),
            Body=body,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=_checksum.encode(crc),
            **conditions,
        )

    def abort_upload(self, key: str, upload_id: str) -> None:
        """Abort one multipart upload; one already gone counts as aborted."""
        full = f"{self.prefix}/{key}" if self.prefix else key
        try:
            self.retrying(
                "abort multipart upload",
                key,
                lambda: self.call("abort_multipart_upload", key, Key=full, UploadId=upload_id),
            )
        except StorageError as err:
            if client_error_code(err) != "NoSuchUpload":  # gone already: fine
                raise
