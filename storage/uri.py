"""Turn a storage URI into an :class:`~storage.backend.ObjectStore`.

``file:///abs/path``     -> :class:`~storage.local.LocalStore` (the directory is created)
``/abs/path``            -> same as ``file:///abs/path``
``s3://bucket[/prefix]`` -> :class:`~storage.s3.S3Store`, settings from the S3_* environment
``memory://[name]``      -> a fresh :class:`~storage.memory.MemoryStore` (tests only)

Anything else raises :class:`~storage.errors.StorageConfigError`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from shoal.core.connection import redact_url
from shoal.storage.backend import ObjectStore
from shoal.storage.errors import StorageConfigError


def open_store(uri: str, *, create_bucket: bool = False) -> ObjectStore:
    """The store named by ``uri``. ``create_bucket`` makes a missing S3 bucket."""
    if uri.startswith("/"):
        uri = "file://" + uri
    parts = urlsplit(uri)
    if parts.query or parts.fragment:
        raise StorageConfigError(f"storage URI must not have a query or fragment: {uri!r}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise StorageConfigError(f"file URI must be file:///absolute/path, got {uri!r}")
        from shoal.storage.local import LocalStore

        return LocalStore(unquote(parts.path))
    if parts.scheme == "s3":
        if parts.username or parts.password:
            raise StorageConfigError("s3:// URIs must not carry credentials; use S3_ACCESS_KEY")
        from shoal.storage.s3 import S3Store

        return S3Store(parts.netloc, unquote(parts.path).strip("/"), create_bucket=create_bucket)
    if parts.scheme == "memory":
        from shoal.storage.memory import MemoryStore

        return MemoryStore(parts.netloc or None)
    raise StorageConfigError(
        f"unsupported storage URI {redact_url(uri)!r}: use file:///path, s3://bucket/prefix or memory://"
    )
