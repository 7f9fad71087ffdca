"""Reason strings are for people: no module outside the tests reads a decision, a chart or a
report out of one (the control entry's typed fields, the worker record's ``cause``, the
failure entry's ``rank`` carry those facts). A grep over the installed modules, so a reader
that starts parsing reason text again fails here."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import ROOT

#: Reading a text named like a reason: membership tests on it (``"x" in reason``), string
#: searches (``reason.startswith(...)``, ``.split(``, ``.find(``...) and regular expressions
#: over it.
PATTERNS = [
    re.compile(r"""['"][^'"\n]*['"]\s+(?:not\s+)?in\s+[\w.]*reason\w*\b(?!\s*=)"""),
    re.compile(r"""['"][^'"\n]*['"]\s+(?:not\s+)?in\s+\w+\[['"]reason['"]\]"""),
    re.compile(r"""reason\w*(?:\[['"]reason['"]\])?\)?\.(?:search|findall|match|fullmatch|startswith|endswith|split|"""
               r"""rsplit|partition|find|index|count)\("""),
    re.compile(r"""\bre\.\w+\([^)\n]*\breason"""),
    re.compile(r"""\.(?:search|findall|match|fullmatch)\([^)\n]*\breason"""),
]
PACKAGES = ("api", "coordinator", "core", "events", "ops", "storage", "worker", "examples", "bench", "scripts")


def offenders() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if any(p.search(code) for p in PATTERNS):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_no_module_reads_facts_out_of_a_reason() -> None:
    assert offenders() == []


def test_the_grep_finds_what_it_is_for(tmp_path: Path) -> None:
    caught = [
        'if "w1 failed" in d["reason"]:',
        "m = _WORLD.search(reason)",
        "left = _LEFT.findall(entry.reason)",
        "if status.reason.startswith('job failed'):",
        'paused = "paused" in reason',
    ]
    fine = ['reason = f"{wid} left"', "return Decision(state, (), reason)", 'why = "; ".join(reasons)']
    assert all(any(p.search(line) for p in PATTERNS) for line in caught)
    assert not any(p.search(line) for p in PATTERNS for line in fine)
