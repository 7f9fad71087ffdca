"""Fuzzed job specs and cluster files through the real CLI entry point (``shoal.ops.cli.main``,
in-process so hypothesis can try many documents): random YAML text, bytes, and structural
mutations of a valid spec / of examples/cluster.yaml. Each command either accepts the file
or refuses it with exit status 2 and exactly one ``shoal: ...`` line on stderr, never a
traceback; a refused ``submit``/``create`` writes nothing to Redis (checked on a logical
database of its own), and an accepted spec reads back from Redis as the spec it was."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import pytest
import redis
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shoal.events.keys import job_keys
from shoal.ops.cli import main
from shoal.core.jobspec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
FUZZ_DB = 9  # a logical database only this module uses: "nothing written" is DBSIZE == 0
#: SHOAL_FUZZ_EXAMPLES=5000 hunts longer (and with fresh randomness) than the default suite does.
EXAMPLES = int(os.environ.get("SHOAL_FUZZ_EXAMPLES", "0")) or 120
SETTINGS = settings(max_examples=EXAMPLES, deadline=None if EXAMPLES == 120 else 5000,
                    derandomize=EXAMPLES == 120,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

VALID_SPEC = {"name": "fuzz-job", "entrypoint": "simulate", "min_workers": 1, "max_workers": 3,
              "global_batch_size": 30, "heartbeat_interval": 0.2, "heartbeat_ttl": 1.0, "max_steps": 10,
              "shard_strategy": "hash", "checkpoint_uri": "file:///tmp/ck", "simulate_step_time": 0.01}
VALID_CLUSTER = yaml.safe_load((ROOT / "examples" / "cluster.yaml").read_text())

_words = st.sampled_from(["simulate", "a:b", "file:///x", "s3://b/p", "{x}", "-oProxyCommand=x", "localhost",
                          "::1", "", "0", "1e3", ".inf", ".nan", "~", "ssh", "local", "discrete", "unified",
                          "hash", "contiguous", "GPU-1", "name", "nodes", "\x00", "é", "a" * 70])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(),
                     st.text(max_size=12), _words)
_edges = st.sampled_from([0, -1, 1, 2**63, 0.0, -0.0, 1e-300, 1e300, float("inf"), float("nan")])
_numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(), _edges)
_values = st.recursive(
    _scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8) | _words, c, max_size=3),
    max_leaves=6)


def _paths(doc, prefix=()):
    """The path (tuple of keys / indexes) of every node of a YAML document tree."""
    yield prefix
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _replacement(data, old):
    """A new value for ``old``: mostly one of the same kind (numbers near the edges, other
    words), sometimes anything at all."""
    if data.draw(st.booleans(), label="same kind"):
        if isinstance(old, (int, float)) and not isinstance(old, bool):
            return data.draw(_numbers, label="number")
        if isinstance(old, str):
            return data.draw(_words | st.text(max_size=12), label="word")
    return data.draw(_values, label="value")


def _mutate(data, doc):
    """A copy of ``doc`` with a few random edits: replace, delete or add a value anywhere."""
    doc = yaml.safe_load(yaml.safe_dump(doc))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        paths = list(_paths(doc))
        path = data.draw(st.sampled_from(paths), label="path")
        if not path:
            doc = data.draw(_values, label="whole document") if data.draw(st.booleans()) else doc
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        op = data.draw(st.sampled_from(["replace", "delete", "add"]), label="op")
        if op == "replace":
            parent[path[-1]] = _replacement(data, parent[path[-1]])
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8) | _words, label="new key")] = data.draw(_values, label="value")
        else:
            parent.append(data.draw(_values, label="value"))
    return doc


def _text_mutation(data, text: str) -> str:
    """The YAML text with a slice replaced by random characters (syntax errors, odd tokens)."""
    i = data.draw(st.integers(0, len(text)), label="at")
    j = data.draw(st.integers(i, min(len(text), i + 20)), label="to")
    return text[:i] + data.draw(st.text(alphabet=st.sampled_from("{}[]:-&*!|>'\"#%@`\t\n ,?ax0"), max_size=8)) + text[j:]


def _document(data, base) -> bytes:
    kind = data.draw(st.sampled_from(["mutated", "mutated", "text-mutated", "random text", "bytes"]), label="kind")
    if kind == "mutated":
        return yaml.safe_dump(_mutate(data, base), allow_unicode=data.draw(st.booleans())).encode()
    if kind == "text-mutated":
        return _text_mutation(data, yaml.safe_dump(base)).encode()
    if kind == "random text":
        return data.draw(st.text(max_size=200), label="text").encode("utf-8", "surrogatepass")
    return data.draw(st.binary(max_size=100), label="bytes")


def _shoal_in_process(*argv: str) -> tuple[int, str, str]:
    """``shoal ARGV`` through :func:`main` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse usage errors
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def _refused_in_one_line(rc: int, out: str, err: str) -> None:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    assert err.startswith("shoal: ") and err.count("\n") == 1 and err.endswith("\n"), err


@pytest.fixture
def fuzz_redis(redis_server, monkeypatch):
    url = f"redis://127.0.0.1:{redis_server.port}/{FUZZ_DB}"
    monkeypatch.setenv("REDIS_URL", url)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.mark.parametrize("command", ["submit", "create"])
@SETTINGS
@given(data=st.data())
@example(data=None)  # the valid spec itself is accepted
def test_fuzzed_job_spec_is_accepted_or_refused_in_one_line(fuzz_redis, command, data) -> None:
    body = yaml.safe_dump(VALID_SPEC).encode() if data is None else _document(data, VALID_SPEC)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_bytes(body)
        rc, out, err = _shoal_in_process(command, str(path))
    if rc != 0:
        _refused_in_one_line(rc, out, err)
        assert fuzz_redis.dbsize() == 0, fuzz_redis.keys("*")
        return
    assert "Traceback" not in out + err
    name = out.splitlines()[0]
    stored = fuzz_redis.get(job_keys(name).spec)
    assert stored is not None and fuzz_redis.sismember("shoal:jobs", name)
    # what the coordinator and workers will read back is the spec that was accepted
    assert JobSpec.from_stored(stored) == JobSpec.model_validate(yaml.safe_load(body))
    if data is None:
        assert name == VALID_SPEC["name"]
    fuzz_redis.flushdb()


@pytest.mark.parametrize("action", ["validate", "show"])
@SETTINGS
@given(data=st.data())
@example(data=None)
def test_fuzzed_cluster_file_is_accepted_or_refused_in_one_line(action, data) -> None:
    body = yaml.safe_dump(VALID_CLUSTER).encode() if data is None else _document(data, VALID_CLUSTER)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        path.write_bytes(body)
        rc, out, err = _shoal_in_process("cluster", action, str(path))
    if rc != 0:
        _refused_in_one_line(rc, out, err)
        assert out == ""
        return
    assert err == "" and out
    if action == "validate":
        assert out.count("\n") == 1 and out.startswith(f"{path}: ok: "), out
    if data is None:
        assert "2 node(s)" in out or action == "show"


# What fuzzing found, pinned: each was accepted into Redis unusable, or printed more than one line.
@pytest.mark.parametrize("body, needle", [
    # JSON has no inf/nan: the stored spec held null and no coordinator could read the job back
    ("simulate_step_time: .inf\n", "simulate_step_time: Input should be a finite number"),
    ("straggler_factor: .nan\n", "straggler_factor: Input should be a finite number"),
    # submit queued one launch unit per worker: a huge max_workers never returned
    ("max_workers: 100000000000\n", "max_workers: Input should be less than or equal to 4096"),
    # torch.manual_seed takes 64 bits: a larger seed crashed every worker at start
    ("seed: 100000000000000000000\n", "seed: Input should be less than or equal to 9223372036854775807"),
    ("seed: -1\n", "seed: Input should be greater than or equal to 0"),
    # a field name with a newline (or an escape sequence) split the one-line error
    ('"colour\\nshoal: forged line": red\n', "'colour\\nshoal: forged line': Extra inputs are not permitted"),
    ('"\\e[31mred": 1\n', "'\\x1b[31mred': Extra inputs"),
])
@pytest.mark.parametrize("command", ["submit", "create"])
def test_spec_inputs_found_by_fuzzing(fuzz_redis, tmp_path, command, body, needle) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"name: pinned\nentrypoint: simulate\n{body}")
    rc, out, err = _shoal_in_process(command, str(path))
    _refused_in_one_line(rc, out, err)
    assert needle in err, err
    assert fuzz_redis.dbsize() == 0


@pytest.mark.parametrize("command", ["submit", "create"])
def test_a_control_character_in_a_file_name_stays_on_one_line(fuzz_redis, tmp_path, command) -> None:
    path = tmp_path / "job\nshoal: forged\x1b[2J.yaml"
    rc, out, err = _shoal_in_process(command, str(path))
    _refused_in_one_line(rc, out, err)
    assert "cannot read job spec" in err and "job\\nshoal: forged\\x1b[2J.yaml" in err, err


@pytest.mark.parametrize("body, needle", [
    ('"no\\nnodes": 1\n', "not a cluster file: no 'nodes' list (found: 'no\\nnodes')"),
    ('nodes:\n  - name: a\n    cpu_cores: 1\n    "x\\ny": 2\n', "nodes[a].'x\\ny': unknown field"),
])
def test_cluster_inputs_found_by_fuzzing(tmp_path, body, needle) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(body)
    rc, out, err = _shoal_in_process("cluster", "validate", str(path))
    _refused_in_one_line(rc, out, err)
    assert needle in err, err
