"""The checkpoint manifest: what a checkpoint holds and how to verify it.

``manifest.json`` is plain JSON, parsed strictly (unknown fields, wrong types and malformed
digests are rejected), never unpickled. Fields:

``format``         manifest format version (1)
``step``           global optimizer step the state was taken after
``epoch``          epoch counter
``data_cursor``    JSON value telling the data loader where to resume
``generation``     membership generation that wrote it
``world_size``     number of workers in that generation
``files``          ``{name: {"size": bytes, "sha256": hex}}`` of every state file
``shards``         absent for a full checkpoint (``model.pt``, ...); S for a sharded one
                   written by a replica group of S members (:mod:`shoal.storage.sharded`)
``job_id``         the job that wrote it (absent in checkpoints written before jobs were
                   recorded): a job resumes only its own (:mod:`shoal.storage.ownership`)
``torch_version``  ``torch.__version__`` of the writer
``created_at``     UTC ISO-8601 time of writing
``hmac``           optional hex HMAC-SHA256 of the canonical JSON of all other fields

The HMAC key comes from ``SHOAL_CHECKPOINT_HMAC_KEY`` (see :func:`hmac_key_from_env`); it is
never logged. When a key is configured, a manifest without a valid HMAC is refused with
:class:`~storage.errors.UnsafeCheckpoint`; since the manifest pins every file's sha256, the
HMAC authenticates the whole checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac as _hmac
import json
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, ValidationError

from shoal.events import envvars
from shoal.storage.errors import CheckpointCorrupt, UnsafeCheckpoint
from shoal.events.validation import first_error

HMAC_ENV = envvars.CHECKPOINT_HMAC_KEY

FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]
HexDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
#: a job id (``shoal.events.keys.valid_job_id``'s rule)
JobId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FileEntry(BaseModel):
    """Size and sha256 of one state file."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    size: int = Field(ge=0)
    sha256: HexDigest


class Manifest(BaseModel):
    """A checkpoint's manifest. Build with :meth:`create`, read with :meth:`parse`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: Literal[1] = 1
    step: int = Field(ge=0)
    epoch: int = Field(ge=0)
    data_cursor: JsonValue
    generation: int = Field(ge=0)
    world_size: int = Field(ge=1)
    files: dict[FileName, FileEntry] = Field(min_length=1)
    shards: int | None = Field(default=None, ge=1)
    job_id: JobId | None = None
    torch_version: str
    created_at: str
    hmac: HexDigest | None = None

    @classmethod
    def create(cls, **fields) -> Manifest:
        """A manifest stamped with the current torch version and UTC time."""
        import torch

        fields.setdefault("torch_version", str(torch.__version__))
        fields.setdefault("created_at", datetime.now(UTC).isoformat(timespec="milliseconds"))
        return cls(**fields)

    @classmethod
    def parse(cls, data: bytes, *, where: str = "manifest") -> Manifest:
        """Parse manifest JSON; any defect raises CheckpointCorrupt naming ``where``."""
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise CheckpointCorrupt(f"{where}: invalid manifest at {first_error(exc)}") from exc

    def canonical_bytes(self) -> bytes:
        """The bytes the HMAC covers: every field but ``hmac``, sorted keys, no spaces."""
        body = self.model_dump(mode="json", exclude={"hmac"})
        for optional in _OPTIONAL:  # unset, the bytes are those before the field existed
            if body[optional] is None:
                del body[optional]
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    def to_json(self) -> bytes:
        unset = {name for name in _OPTIONAL if getattr(self, name) is None}
        return (self.model_dump_json(indent=2, exclude=unset or None) + "\n").encode()

    def signed(self, key: bytes | None) -> Manifest:
        """A copy carrying the HMAC under ``key``; unchanged (no HMAC) when ``key`` is None."""
        if key is None:
            return self
        return self.model_copy(update={"hmac": _digest(key, self.canonical_bytes())})

    def check_signature(
        self, key: bytes | None, *, where: str, on_warning: Callable[[str], None] | None = None
    ) -> None:
        """Raise UnsafeCheckpoint if ``key`` is set and the HMAC is missing or wrong. Without
        a key a present HMAC cannot be checked: ``on_warning`` is told so and loading goes on."""
        if key is None:
            if self.hmac is not None and on_warning is not None:
                on_warning(f"{where}: manifest is HMAC-signed but {HMAC_ENV} is not set; not verified")
            return
        if self.hmac is None:
            raise UnsafeCheckpoint(f"{where}: manifest has no HMAC but {HMAC_ENV} is set")
        if not _hmac.compare_digest(self.hmac, _digest(key, self.canonical_bytes())):
            raise UnsafeCheckpoint(f"{where}: manifest HMAC does not match (tampered or wrong key)")


#: fields left out of the JSON (and of the HMAC's bytes) when unset: older manifests lack them
_OPTIONAL = ("shards", "job_id")


def _digest(key: bytes, data: bytes) -> str:
    return _hmac.new(key, data, hashlib.sha256).hexdigest()


def hmac_key_from_env() -> bytes | None:
    """The HMAC key from ``SHOAL_CHECKPOINT_HMAC_KEY`` (UTF-8), or None if unset/empty."""
    value = os.environ.get(HMAC_ENV, "")
    return value.encode() if value else None


class _FromEnv:
    """Marker default: read the HMAC key from the environment at call time."""

    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV = _FromEnv()
HmacKey = bytes | None | _FromEnv


def resolve_hmac_key(key: HmacKey) -> bytes | None:
    """``key`` itself, or :func:`hmac_key_from_env` for :data:`FROM_ENV`; None disables."""
    return hmac_key_from_env() if isinstance(key, _FromEnv) else key
