"""S3/MinIO backend through the ``minio`` client.

Objects live under ``s3://<bucket>/<prefix>/<key>``. A PUT is atomic per object on S3 (a
reader sees the old or the new object), so :meth:`S3Store.open_write` spools what is written
to a local temporary file (memory up to 16 MiB) and uploads it in one ``put_object`` when the
block exits normally; large objects go up as a multipart upload, which S3 also publishes
atomically on completion. All HTTP calls have connect/read timeouts and a bounded number of
retries (:class:`~storage.s3_config.S3Config`). The secret key is only handed to the client.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from shoal.storage.backend import ObjectStore, check_key, check_prefix
from shoal.storage.errors import ObjectNotFound, StorageConfigError, translated
from shoal.storage.s3_config import S3Config

_SPOOL_MAX = 16 * 1024 * 1024


def _http_client(config: S3Config):
    import certifi
    import urllib3

    return urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s),
        maxsize=10,
        cert_reqs="CERT_REQUIRED",
        ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
        retries=urllib3.Retry(
            total=config.retries, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]
        ),
    )


class S3Store(ObjectStore):
    """Objects in ``bucket`` under ``prefix``. With ``create_bucket`` a missing bucket is
    made; otherwise a missing bucket raises StorageConfigError on first use."""

    def __init__(
        self, bucket: str, prefix: str = "", config: S3Config | None = None, *, create_bucket: bool = False
    ) -> None:
        from minio import Minio

        if not bucket:
            raise StorageConfigError("S3 URI needs a bucket: s3://bucket/prefix")
        self.config = config or S3Config.from_env()
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.client = Minio(
            self.config.endpoint,
            access_key=self.config.access_key,
            secret_key=self.config.secret_key.reveal(),
            secure=self.config.secure,
            region=self.config.region,
            http_client=_http_client(self.config),
        )
        if create_bucket:
            self._ensure_bucket()

    def _ensure_bucket(self) -> None:
        from minio.error import S3Error

        with translated(f"create bucket {self.bucket}"):
            if self.client.bucket_exists(self.bucket):
                return
            try:
                self.client.make_bucket(self.bucket, location=self.config.region)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _where(self, key: str) -> str:
        return f"{self.uri}/{key}"

    @contextmanager
    def open_write(self, key: str) -> Iterator[BinaryIO]:
        name = self._name(key)
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_MAX) as spool:
            yield spool  # type: ignore[misc]
            length = spool.tell()
            spool.seek(0)
            with translated(f"put {self._where(key)}"):
                self.client.put_object(self.bucket, name, spool, length)

    def put_bytes(self, key: str, data: bytes) -> None:
        name = self._name(key)
        with translated(f"put {self._where(key)}"):
            self.client.put_object(self.bucket, name, io.BytesIO(data), len(data))

    def put_file(self, key: str, path: str | Path) -> None:
        name = self._name(key)
        with translated(f"put {self._where(key)} from {path}"):
            self.client.fput_object(self.bucket, name, str(path))

    def get_bytes(self, key: str) -> bytes:
        name = self._name(key)
        with translated(f"get {self._where(key)}"):
            resp = self.client.get_object(self.bucket, name)
            try:
                return resp.read()  # urllib3 2 raises on a body shorter than Content-Length
            finally:
                resp.close()
                resp.release_conn()

    @contextmanager
    def open_read(self, key: str) -> Iterator[BinaryIO]:
        """One streaming GET; the body is read as the caller reads."""
        name = self._name(key)
        with translated(f"get {self._where(key)}"):
            resp = self.client.get_object(self.bucket, name)
        try:
            yield resp  # type: ignore[misc]  # urllib3 HTTPResponse: read(n)
        finally:
            resp.close()
            resp.release_conn()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged GET (``Range: bytes=start-start+length-1``)."""
        if start < 0 or length < 0:
            raise ValueError(f"invalid byte range start={start} length={length}")
        if length == 0:
            return b""
        name = self._name(key)
        with translated(f"get {self._where(key)} [{start}:{start + length}]"):
            resp = self.client.get_object(self.bucket, name, offset=start, length=length)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        name = self._name(key)
        with translated(f"stat {self._where(key)}"):
            return int(self.client.stat_object(self.bucket, name).size)

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        cut = len(self.prefix) + 1 if self.prefix else 0
        with translated(f"list {self.uri}/{prefix}"):
            names = [
                o.object_name[cut:]
                for o in self.client.list_objects(self.bucket, prefix=full or None, recursive=True)
                if o.object_name and not o.is_dir
            ]
        return sorted(names)

    def delete(self, key: str) -> None:
        name = self._name(key)
        with translated(f"delete {self._where(key)}"):
            self.client.remove_object(self.bucket, name)
