"""The API token: where it comes from, and the check every changing call goes through.

The token is ``SHOAL_API_TOKEN`` from the environment, or the first line of the file named by
``--token-file`` (which wins: a mounted secret). It is compared in constant time
(:func:`hmac.compare_digest`) and never logged, echoed or stored. With no token the server is
read-only: every changing call is refused (403) and says how to configure one.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi import HTTPException, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shoal.events import envvars
from shoal.core.errors import ConfigError

ENV_TOKEN = envvars.API_TOKEN
#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN_CHARS = 16

_bearer = HTTPBearer(auto_error=False, description=f"the server's API token ({envvars.API_TOKEN} or --token-file)")


def load_token(token_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The configured token, or None (read-only). ConfigError (one line, never quoting the
    token) for an unreadable or empty file, or a token that is too short or holds spaces."""
    environ = os.environ if environ is None else environ
    if token_file:
        try:
            text = Path(token_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --token-file {token_file}: {getattr(exc, 'strerror', None) or exc}") from None
        lines = text.strip().splitlines()
        token, source = (lines[0].strip() if lines else ""), f"--token-file {token_file}"
        if not token:
            raise ConfigError(f"--token-file {token_file} is empty")
    else:
        token, source = environ.get(ENV_TOKEN, "").strip(), ENV_TOKEN
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(f"the API token from {source} must be at least {MIN_TOKEN_CHARS} characters without "
                          "spaces (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


class TokenCheck:
    """A FastAPI dependency: passes when the request carries ``Authorization: Bearer <token>``
    matching the configured token; 401 (with ``WWW-Authenticate: Bearer``) when it carries
    none or another; 403 when the server has no token (read-only)."""

    def __init__(self, token: str | None):
        self._token = token.encode() if token else None

    @property
    def read_only(self) -> bool:
        return self._token is None

    async def __call__(self, creds: HTTPAuthorizationCredentials | None = Security(_bearer)) -> None:
        if self._token is None:
            raise HTTPException(403, f"this server is read-only: no API token is configured (set {ENV_TOKEN} "
                                     "or --token-file when starting shoal serve)")
        if creds is None:
            raise HTTPException(401, "this call changes something: send Authorization: Bearer <token>",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(creds.credentials.encode(), self._token):
            raise HTTPException(401, "wrong API token", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
