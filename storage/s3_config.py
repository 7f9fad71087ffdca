"""Where S3 settings come from: environment variables, optionally a credentials file.

Variables (each overrides the same field of the credentials file):

``S3_ENDPOINT``          ``host:port`` or ``http(s)://host:port`` (the scheme sets ``secure``)
``S3_ACCESS_KEY``        access key id
``S3_SECRET_KEY``        secret key (kept in a :class:`Secret`; never logged or repr'd)
``S3_SECURE``            ``1/true/yes`` or ``0/false/no``; default true unless the endpoint
                         says ``http://``
``S3_REGION``            optional region name
``S3_CREDENTIALS_FILE``  path of a JSON object with any of the keys ``endpoint``,
                         ``access_key``, ``secret_key``, ``secure``, ``region``

Missing or malformed settings raise :class:`~storage.errors.StorageConfigError` naming the
variable, never its value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from shoal.storage.errors import StorageConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Secret:
    """A string that does not show itself: ``repr``/``str``/f-strings print ``***``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The actual secret, for handing to the client library only."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __copy__(self) -> Secret:
        return self

    def __deepcopy__(self, memo: dict) -> Secret:
        return self

    def __reduce__(self):  # refuse to be pickled into logs, events or checkpoints
        raise TypeError("Secret values cannot be pickled")


@dataclass(frozen=True)
class S3Config:
    """Connection settings of one S3-compatible endpoint. Safe to print."""

    endpoint: str  # host[:port], no scheme
    access_key: str
    secret_key: Secret
    secure: bool = True
    region: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    retries: int = 3

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Config:
        """Settings from ``env`` (default ``os.environ``) and the optional credentials file."""
        env = os.environ if env is None else env
        file_values = _read_credentials_file(env.get("S3_CREDENTIALS_FILE"))

        def pick(var: str, field: str) -> str | None:
            value = env.get(var)
            if value is None or value == "":
                value = file_values.get(field)
            return None if value is None else str(value)

        raw_endpoint = pick("S3_ENDPOINT", "endpoint")
        access = pick("S3_ACCESS_KEY", "access_key")
        secret = pick("S3_SECRET_KEY", "secret_key")
        missing = [v for v, x in (("S3_ENDPOINT", raw_endpoint), ("S3_ACCESS_KEY", access),
                                  ("S3_SECRET_KEY", secret)) if not x]
        if missing:
            raise StorageConfigError(
                f"S3 settings missing: {', '.join(missing)} (set them or S3_CREDENTIALS_FILE)"
            )
        endpoint, scheme_secure = _split_endpoint(raw_endpoint)  # type: ignore[arg-type]
        secure_text = pick("S3_SECURE", "secure")
        secure = _parse_bool("S3_SECURE", secure_text) if secure_text is not None else scheme_secure
        return cls(
            endpoint=endpoint,
            access_key=access,  # type: ignore[arg-type]
            secret_key=Secret(secret),  # type: ignore[arg-type]
            secure=secure,
            region=pick("S3_REGION", "region"),
        )


def _read_credentials_file(path: str | None) -> dict[str, object]:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise StorageConfigError(f"cannot read S3_CREDENTIALS_FILE {path}: {exc.strerror}") from exc
    except ValueError:
        # The message of a JSON error may quote file content (the secret): do not chain it.
        raise StorageConfigError(f"S3_CREDENTIALS_FILE {path} is not valid JSON") from None
    if not isinstance(data, dict):
        raise StorageConfigError(f"S3_CREDENTIALS_FILE {path} must hold a JSON object")
    return data


def _split_endpoint(raw: str) -> tuple[str, bool]:
    """``host:port`` and whether the scheme (if any) asked for TLS (default True)."""
    if "://" not in raw:
        return raw.rstrip("/"), True
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
        raise StorageConfigError("S3_ENDPOINT must be host:port or http(s)://host:port")
    if parts.username or parts.password:
        raise StorageConfigError("S3_ENDPOINT must not carry credentials; use S3_ACCESS_KEY")
    return parts.netloc, parts.scheme == "https"


def _parse_bool(var: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise StorageConfigError(f"{var} must be one of 1/0/true/false/yes/no")
