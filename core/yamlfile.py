"""Reading a user's YAML file (job spec, cluster file): every failure is one ConfigError line."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from shoal.core.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, reading numbers as YAML 1.2 (and JSON) do: ``3e-4`` and
    ``1E6`` are floats. PyYAML follows YAML 1.1, where a float needs a dot (``3.0e-4``), so
    ``lr: 3e-4`` would reach a job's ``build(lr=...)`` as the string ``"3e-4"``."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_text(text: str) -> object:
    """One YAML document, numbers read as YAML 1.2 does (see :class:`_Loader`); raises
    ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def parse_scalar(text: str) -> object:
    """A ``--set key=value`` value as YAML would read it (``3e-4`` a float, ``true`` a bool,
    ``[1, 2]`` a list); the text itself when it is not valid YAML."""
    try:
        return load_text(text)
    except yaml.YAMLError:
        return text


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
    """Parse ``path`` as ``yaml.safe_load`` does, numbers as YAML 1.2 reads them (``3e-4``:
    a float; :func:`load_text`); ConfigError names the file, and for a syntax error the line
    and column, when it is unreadable, not UTF-8 or not YAML."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"cannot read {what} {p}: not UTF-8 text") from exc
    try:
        return load_text(text)
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML{where}: {problem}") from exc
