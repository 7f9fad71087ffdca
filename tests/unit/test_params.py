"""Issue 37: ``params:`` in the job spec are the entrypoint's keyword arguments - validated as
JSON values with identifier names, read from YAML as YAML 1.2 reads numbers (``3e-4`` is a
float), checked against the function's signature (the missing or unexpected argument named in
one line) and passed to it."""

from __future__ import annotations

import pytest

from shoal.core.errors import ConfigError
from shoal.core.jobspec import load_spec, parse_spec
from shoal.ops.cli import build_parser, _spec_fields
from shoal.worker.errors import EntrypointError
from shoal.worker.userapi import load_entrypoint, params_problem, resolve_entrypoint

STEADY = "tests.entrypoints:steady_digits"


def test_params_are_json_values_under_identifier_names() -> None:
    spec = parse_spec({"name": "p", "params": {"lr": 3e-4, "layers": [2, 4], "act": "gelu", "opt": {"b": None}}})
    assert spec.params == {"lr": 3e-4, "layers": [2, 4], "act": "gelu", "opt": {"b": None}}
    assert parse_spec({"name": "p"}).params == {}
    for bad, named in (({"class": 1}, "'class' is not a keyword argument name"),
                       ({"n-layer": 1}, "'n-layer' is not a keyword argument name"),
                       ({"lr": float("nan")}, "params.lr"), ([1], "params")):
        with pytest.raises(ConfigError, match=named) as err:
            parse_spec({"name": "p", "params": bad})
        assert "\n" not in str(err.value)


def test_yaml_numbers_read_as_yaml_1_2_so_an_exponent_is_a_float(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("name: p\nparams:\n  lr: 3e-4\n  wd: 1E2\n  steps: 1_000\n  tag: 1e\n  eps: -1.5e-08\n")
    assert load_spec(path).params == {"lr": 3e-4, "wd": 100.0, "steps": 1000, "tag": "1e", "eps": -1.5e-8}


def _args(*argv: str):
    return build_parser().parse_args(["create", *argv])


def test_set_reaches_into_params_and_keeps_the_files_other_entries(tmp_path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: p\nentrypoint: {STEADY}\nparams: {{width: 16, pace: 0.5}}\n")
    spec = _spec_fields(_args(str(path), "--set", "params.width=32", "--set", "params.lr=1e-3"))
    assert spec.params == {"width": 32, "pace": 0.5, "lr": 1e-3}
    assert _spec_fields(_args("--name", "q", "--set", "params.width=8")).params == {"width": 8}
    for bad, message in (("params.=1", "an empty name"), ("params.width.x=1", "params.width is not a mapping"),
                         ("name.x=1", "name is not a mapping")):
        with pytest.raises(ConfigError, match=message):
            _spec_fields(_args(str(path), "--set", bad))


def test_the_signature_check_names_the_missing_or_unexpected_argument_in_one_line() -> None:
    def build(width: int, lr: float = 0.1, *, depth: int = 2): ...

    def positional(width, /): ...

    def anything(**kw): ...

    assert params_problem(build, {"width": 3}) == ""
    assert params_problem(build, {"width": 3, "depth": 4, "lr": 1.0}) == ""
    missing = params_problem(build, {"lr": 1.0})
    assert missing.startswith("missing argument 'width': build(width, lr=0.1, *, depth=2) has no default for it")
    assert "--set params.width=VALUE" in missing
    assert params_problem(build, {"width": 3, "widht": 4}).startswith("unexpected argument 'widht' in params")
    assert "positional-only argument 'width'" in params_problem(positional, {"width": 1})
    assert params_problem(anything, {"x": 1}) == ""


def test_resolve_and_load_pass_params_and_refuse_a_mismatch() -> None:
    with pytest.raises(EntrypointError, match=r"^entrypoint 'tests.entrypoints:steady_digits': missing argument "
                                              r"'width'") as err:
        resolve_entrypoint(STEADY)
    assert "\n" not in str(err.value)
    with pytest.raises(EntrypointError, match="unexpected argument 'lr' in params"):
        resolve_entrypoint(STEADY, {"width": 4, "lr": 0.1})
    setup = load_entrypoint(STEADY, 0, {"width": 24, "pace": 0.0})
    assert setup.model[0].out_features == 24
    # the digits example takes no params, and none is what it gets
    assert load_entrypoint("shoal.examples.digits:build", 0, {}).model[0].out_features == 128


def test_status_shows_the_params_the_entrypoint_is_called_with() -> None:
    import fakeredis

    from shoal.core.registry import create_job
    from shoal.ops.status import format_status, job_status

    r = fakeredis.FakeRedis()
    create_job(r, parse_spec({"name": "p", "entrypoint": STEADY, "params": {"width": 8, "act": "gelu"}}))
    s = job_status(r, "p")
    assert s["params"] == {"width": 8, "act": "gelu"}
    assert 'params: width=8 act="gelu"' in format_status(s).splitlines()
    create_job(r, parse_spec({"name": "q"}))
    assert job_status(r, "q")["params"] == {} and "params:" not in format_status(job_status(r, "q"))
