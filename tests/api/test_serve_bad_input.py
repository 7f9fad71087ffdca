"""``shoal serve`` refuses bad settings before it serves anything: one line naming the cause,
exit status 2, no traceback, and never the token itself."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import run_cli


@pytest.fixture
def listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_bad_settings_are_one_line_and_exit_2(cli_env, tmp_path, listening_port) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        (["--token-file", str(tmp_path / "missing")], {}, "cannot read --token-file"),
        (["--token-file", str(empty)], {}, "is empty"),
        ([], {"SHOAL_API_TOKEN": "tooshort-secret"}, "at least 16 characters"),
        ([], {"SHOAL_API_TOKEN": "a long token with spaces in it"}, "without spaces"),
        (["--port", str(listening_port)], {}, f"cannot listen on 127.0.0.1:{listening_port}"),
        (["--port", "70000"], {}, "--port must be 0..65535"),
        (["--host", "no-such-host.invalid"], {}, "cannot listen on no-such-host.invalid"),
    ]
    for args, extra, expected in cases:
        res = run_cli({**cli_env, **extra}, "serve", *args, timeout=60)
        assert res.returncode == 2, (args, res.stderr)
        last = res.stderr.strip().splitlines()[-1]
        assert last.startswith("shoal: ") and expected in last, (args, res.stderr)
        assert "Traceback" not in res.stderr
        for secret in extra.values():
            assert secret not in res.stderr + res.stdout
