"""A job's code, shipped with it: the spec's ``working_dir`` as a checksummed archive.

Like Ray's ``runtime_env.working_dir``: ``shoal submit``/``create`` packs the directory
(:func:`pack_dir`) into a gzip'd tar - deterministic (sorted names, no times or owners), so
the same files give the same SHA-256 - and stores it in the job's ``code`` hash in the same
transaction as the spec. Each node agent reads it (:meth:`CodePackage.read`), checks the
checksum and unpacks it (:func:`unpack`) into a per-job directory that becomes its workers'
working directory and first ``sys.path`` entry.

Bounded at both ends: at most MAX_PACKAGE_BYTES compressed, MAX_UNPACKED_BYTES and
MAX_FILES unpacked, checked while packing (a one-line error names the largest files and
``working_dir_excludes``) and again while unpacking (a forged archive cannot fill a disk).
Only regular files and directories are packed and unpacked; a member with an absolute path,
``..``, a link or a device is refused. Nothing is unpickled: the archive holds file bytes.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import redis

from shoal.core.errors import ConfigError
from shoal.storage.errors import StorageError

MiB = 1024 * 1024
#: Largest archive stored in Redis (one value; Redis handles it, but every agent reads it).
MAX_PACKAGE_BYTES = 64 * MiB
#: Largest total size and number of files a package may unpack to.
MAX_UNPACKED_BYTES = 512 * MiB
MAX_FILES = 50_000
#: Left out of every package (matched against each name and each relative path).
DEFAULT_EXCLUDES = (
    ".git", ".hg", ".svn", "__pycache__", "*.pyc", "*.pyo", ".venv", "venv", ".tox", "node_modules",
    ".mypy_cache", ".pytest_cache", ".ruff_cache", "*.egg-info", ".ipynb_checkpoints", ".DS_Store",
)
#: Written last into an unpacked directory: a directory without it is incomplete.
_COMPLETE = ".shoal-complete"


class CodePackageError(StorageError):
    """A stored package is missing, corrupt, unsafe or too large to unpack (one line)."""


@dataclass(frozen=True)
class CodePackage:
    data: bytes
    sha256: str
    size: int  # bytes unpacked
    files: int

    def write(self, pipe: redis.Redis, key: str) -> None:
        """Store the package at ``key`` (a HASH), e.g. inside the submit transaction."""
        pipe.delete(key)
        pipe.hset(key, mapping={"sha256": self.sha256, "size": self.size, "files": self.files, "tar": self.data})

    @classmethod
    def read(cls, client: redis.Redis, key: str) -> "CodePackage | None":
        """The package stored at ``key``, its checksum verified; None when there is none."""
        h = client.hgetall(key)
        if not h:
            return None
        try:
            data, sha = h[b"tar"], h[b"sha256"].decode()
            size, files = int(h[b"size"]), int(h[b"files"])
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CodePackageError(f"the job's code package at {key} is malformed ({exc!r} missing or bad)") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            raise CodePackageError(f"the job's code package at {key} is corrupt: its SHA-256 is {actual[:12]}..., "
                                   f"the recorded one {sha[:12]}...")
        return cls(data, sha, size, files)


def _excluded(rel: str, name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(rel, p.rstrip("/"))
               for p in patterns)


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


def pack_dir(root: str | Path, excludes: Sequence[str] = ()) -> CodePackage:
    """Pack the regular files under ``root`` (following links to files, not into linked
    directories), leaving out DEFAULT_EXCLUDES and ``excludes``. ConfigError (one line) when
    ``root`` is not a directory, a file cannot be read, or a bound is exceeded."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"working_dir {root}: no such directory")
    patterns = (*DEFAULT_EXCLUDES, *excludes)
    entries: list[tuple[str, Path, int, bool]] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        rel_dir = base.relative_to(root).as_posix()
        dirnames[:] = sorted(d for d in dirnames
                             if not _excluded(d if rel_dir == "." else f"{rel_dir}/{d}", d, patterns))
        for name in sorted(filenames):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            path = base / name
            if _excluded(rel, name, patterns) or not path.is_file():
                continue  # excluded, or a link to a directory, a socket, a dangling link...
            try:
                st = path.stat()
            except OSError as exc:
                raise ConfigError(f"working_dir {root}: cannot read {rel}: {exc.strerror}") from None
            total += st.st_size
            entries.append((rel, path, st.st_size, bool(st.st_mode & 0o111)))
            if len(entries) > MAX_FILES or total > MAX_UNPACKED_BYTES:
                biggest = sorted(entries, key=lambda e: -e[2])[:3]
                raise ConfigError(
                    f"working_dir {root}: more than {MAX_FILES} files or {_mib(MAX_UNPACKED_BYTES)} "
                    f"(largest: {', '.join(f'{e[0]} ({_mib(e[2])})' for e in biggest)}); "
                    "leave data out with working_dir_excludes")
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=6) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for rel, path, size, executable in entries:
                info = tarfile.TarInfo(rel)
                info.size, info.mode, info.mtime = size, 0o755 if executable else 0o644, 0
                try:
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                except OSError as exc:
                    raise ConfigError(f"working_dir {root}: cannot read {rel}: {exc.strerror}") from None
                if buf.tell() > MAX_PACKAGE_BYTES:
                    raise ConfigError(f"working_dir {root}: the package exceeds {_mib(MAX_PACKAGE_BYTES)} compressed "
                                      f"(at {rel}); leave data out with working_dir_excludes")
    data = buf.getvalue()
    if len(data) > MAX_PACKAGE_BYTES:
        raise ConfigError(f"working_dir {root}: the package is {_mib(len(data))} compressed, more than "
                          f"{_mib(MAX_PACKAGE_BYTES)}; leave data out with working_dir_excludes")
    return CodePackage(data, hashlib.sha256(data).hexdigest(), total, len(entries))


def _safe_member(member: tarfile.TarInfo) -> PurePosixPath:
    path = PurePosixPath(member.name)
    if not (member.isfile() or member.isdir()):
        raise CodePackageError(f"the job's code package holds {member.name!r}, which is not a file or directory")
    if path.is_absolute() or ".." in path.parts or not path.parts or "\\" in member.name:
        raise CodePackageError(f"the job's code package holds an unsafe path {member.name!r}")
    return path


def unpack(package: CodePackage, into: Path) -> Path:
    """Unpack ``package`` into ``into/code-<sha>`` and return that directory (reused when a
    complete one exists: agents of one job on one node share it). CodePackageError when the
    archive is unreadable, unsafe or larger than the bounds."""
    dest = into / f"code-{package.sha256[:16]}"
    if (dest / _COMPLETE).exists():
        return dest
    into.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".code-", dir=into))
    try:
        total = count = 0
        with tarfile.open(fileobj=io.BytesIO(package.data), mode="r:gz") as tar:
            for member in tar:
                rel = _safe_member(member)
                count += 1
                total += member.size
                if count > MAX_FILES or total > MAX_UNPACKED_BYTES:
                    raise CodePackageError(f"the job's code package unpacks to more than {MAX_FILES} files or "
                                           f"{_mib(MAX_UNPACKED_BYTES)}")
                target = tmp.joinpath(*rel.parts)
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                with open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                target.chmod(0o755 if member.mode & 0o111 else 0o644)
        (tmp / _COMPLETE).write_text(package.sha256)
        try:
            tmp.rename(dest)
        except OSError:  # another agent of the job on this node was first
            if not (dest / _COMPLETE).exists():
                raise
        return dest
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile) as exc:
        raise CodePackageError(f"the job's code package cannot be unpacked: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
