"""The exactly-once checker must catch what it claims to catch."""

from __future__ import annotations

from shoal.worker.ledger import verify

N = 6


def _entry(step, gen, batch, indices, epoch=0, cursor=None):
    return {"step": step, "generation": gen, "batch": batch, "indices": indices, "epoch": epoch,
            "cursor": cursor if cursor is not None else (step - 1) * 3, "worker": "w", "pid": 1}


def _good():
    return [_entry(1, 1, [4, 1, 0], [4, 1]), _entry(1, 1, [4, 1, 0], [0]),
            _entry(2, 2, [5, 3, 2], [5, 3, 2])]


def test_a_clean_run_passes() -> None:
    v = verify(_good(), N)
    assert v.ok and v.steps == 2 and v.epochs_complete == 1


def test_a_sample_used_twice_is_caught() -> None:
    bad = _good()[:2] + [_entry(2, 2, [5, 3, 1], [5, 3, 1])]
    assert "used twice" in verify(bad, N).problem or "missing" in verify(bad, N).problem


def test_a_step_committed_in_two_generations_is_caught() -> None:
    bad = _good() + [_entry(2, 3, [5, 3, 2], [5, 3, 2])]
    assert "two generations" in verify(bad, N).problem


def test_slices_that_do_not_partition_the_batch_are_caught() -> None:
    bad = [_entry(1, 1, [4, 1, 0], [4, 1]), _entry(1, 1, [4, 1, 0], [1]), _entry(2, 2, [5, 3, 2], [5, 3, 2])]
    assert "partition" in verify(bad, N).problem


def test_gaps_in_committed_steps_are_caught() -> None:
    assert "gaps" in verify([_entry(2, 1, [0], [0])], N).problem


def test_a_step_committed_by_some_ranks_only_is_accepted_if_disjoint() -> None:
    # a peer died in the last exchange: rank 0 committed (holding every rank's gradient), rank 1 adopted it
    partial = [dict(_entry(1, 1, [4, 1, 0], [4, 1]), world=3), _entry(2, 2, [5, 3, 2], [5, 3, 2])]
    v = verify(partial, N)
    assert v.ok and v.partial_commits == 1
    overlapping = [dict(_entry(1, 1, [4, 1, 0], [4, 1]), world=3), dict(_entry(1, 1, [4, 1, 0], [1]), world=3),
                   _entry(2, 2, [5, 3, 2], [5, 3, 2])]
    assert "overlap" in verify(overlapping, N).problem


def test_read_leaves_out_a_line_still_being_written(tmp_path) -> None:
    """A test polls the ledgers while workers append to them: a line not yet ended (or cut
    off by a killed worker) is not an entry, and not a JSON error."""
    import json

    from shoal.worker.ledger import read

    whole = json.dumps(_entry(1, 1, [4, 1, 0], [4, 1]))
    (tmp_path / "ledger-1.jsonl").write_text(whole + "\n" + whole[:20])
    (tmp_path / "ledger-2.jsonl").write_text(whole + "\n")
    assert [e["step"] for e in read(tmp_path)] == [1, 1]


def test_two_processes_with_one_pid_never_share_a_ledger_file(tmp_path, monkeypatch) -> None:
    """Found by scripts/compose_check.py (agent-crash): the agents of a compose stack share one
    ledger folder, each in its own PID namespace, so their workers have the same PIDs; and a
    restarted container's new worker gets its killed predecessor's PID. One file per pid
    would mix two processes' lines, or append a whole line to one a kill cut off (read: a
    JSON error). Each process has a file of its own."""
    import types

    from shoal.worker.ledger import Ledger, read

    monkeypatch.setenv("SHOAL_LEDGER_DIR", str(tmp_path))
    first = Ledger.from_env()  # a worker killed mid-line ...
    first._fh.write('{"step": 2, "cut off')
    first._fh.flush()
    second = Ledger.from_env()  # ... and its successor, with the same pid
    batch = types.SimpleNamespace(cursor=0, epoch=0, count=3, indices=[4, 1, 0])
    second.commit("w1", 1, batch, 1, [4, 1, 0], world=1)
    assert len(list(tmp_path.glob("ledger-*.jsonl"))) == 2
    assert [e["step"] for e in read(tmp_path)] == [1]
