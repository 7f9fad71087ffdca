"""Every cross-process contract is spelled once: a ``SHOAL_*`` environment variable's name
only in ``events/envvars.py`` (every other module imports it from there). A grep over the
installed modules, so a name spelled again as a literal fails here."""

from __future__ import annotations

import re

from shoal.events import envvars
from tests.helpers import ROOT

#: A string literal that starts with ``SHOAL_`` (an f-string's too): a variable's name
#: spelled out. Docstrings and messages that mention one mid-text are not names in use.
LITERAL = re.compile(r"""(?<![\w])[rbf]{0,2}(['"])(SHOAL_[A-Z0-9_]*)""")
PACKAGES = ("api", "coordinator", "core", "events", "ops", "storage", "worker", "examples")
OWNER = "events/envvars.py"
#: Modules still being rewritten by others when the contracts module came (issue 36): they
#: keep their literal until then; each name must still be one of envvars'. Remove an entry
#: once its module imports ``shoal.events.envvars``.
PENDING: dict[str, set[str]] = {}


def literals(text: str) -> set[str]:
    return {m.group(2) for line in text.splitlines() for m in LITERAL.finditer(line.split("#", 1)[0])}


def spelled() -> dict[str, set[str]]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel != OWNER and (names := literals(path.read_text())):
                found[rel] = names
    return found


def test_every_environment_variable_is_spelled_in_one_module() -> None:
    again = {rel: names for rel, names in spelled().items() if not names <= PENDING.get(rel, set())}
    assert again == {}, f"SHOAL_* names spelled outside {OWNER}: import them from shoal.events.envvars"


def test_the_pending_literals_name_declared_variables() -> None:
    unknown = {name for names in PENDING.values() for name in names} - set(envvars.ALL)
    assert unknown == set()


def test_the_grep_finds_what_it_is_for() -> None:
    assert literals('env = {"SHOAL_FAULTS": rule}') == {"SHOAL_FAULTS"}
    assert literals("x = os.environ.get('SHOAL_HOME')") == {"SHOAL_HOME"}
    assert literals('v = f"SHOAL_LM_{k.upper()}"') == {"SHOAL_LM_"}
    assert literals('"""Reads ``SHOAL_FAULTS`` at start."""') == set()
    assert literals('help="the token (SHOAL_API_TOKEN or a file)"') == set()
    assert literals('x = 1  # "SHOAL_HOME" in a comment') == set()
