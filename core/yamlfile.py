"""Reading a user's YAML file (job spec, cluster file): every failure is one ConfigError line."""

from __future__ import annotations

from pathlib import Path

import yaml

from shoal.core.errors import ConfigError


def printable(value: object, limit: int = 60) -> str:
    """A user's key or value as it may appear inside a one-line error message: as is when it
    is printable text, else its escaped repr (so a newline or a terminal escape in a YAML key
    cannot split or forge the message), cut to ``limit`` characters."""
    text = str(value)
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def escape_controls(text: str) -> str:
    """``text`` with every control character (newline, terminal escape...) written as its
    escape, so what a user or a crashed process wrote cannot split, forge or restyle a line
    of shoal's output."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def read_yaml(path: str | Path, what: str) -> object:
    """Parse ``path`` with ``yaml.safe_load``; ConfigError names the file, and for a syntax
    error the line and column, when it is unreadable, not UTF-8 or not YAML."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {what} {p}: not UTF-8 text") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML{where}: {problem}") from exc
