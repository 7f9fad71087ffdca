"""``shoal report``: the progress recorder, the marked membership changes and recovery gaps,
the PNG itself, and the CLI's errors (unknown job: exit 2; no progress yet: exit 1)."""

from __future__ import annotations

import redis

from shoal.coordinator.decide import EventInput, Tick, decide
from shoal.coordinator.persist import control_entry
from shoal.coordinator.states import CoordState
from shoal.events.keys import job_keys
from shoal.events.models import JobCompleted, JoinRequest, LeaveRequest, Left, Ready, WorkerExited
from shoal.events.streams import ControlEntry
from shoal.ops.cli import main
from shoal.ops.embedded import free_port
from shoal.core.registry import create_job
from shoal.core.jobspec import JobSpec
from shoal.ops.report import membership_events, write_report
from shoal.worker.progress import ProgressRecorder

T0 = 1_700_000_000_000  # ms; progress entry ids and control ts_ms share this (Redis server) clock


def progress(r, job: str, t: int, step: int, generation: int, world: int) -> None:
    r.xadd(job_keys(job).progress, {"step": str(step), "loss": repr(2.3 * 0.97 ** step), "generation": str(generation),
                                     "world_size": str(world), "t": f"{(T0 + t) / 1000:.3f}"}, id=f"{T0 + t}-0")


class Coordinator:
    """The real coordinator decisions of a scenario (``coordinator.decide``), written to the
    job's control stream as the coordinator writes them (``persist.control_entry``), at the
    times the test says: the report reads what a real run writes."""

    def __init__(self, r, job: str) -> None:
        self.r, self.job = r, job
        self.spec = JobSpec(name=job, entrypoint="simulate", min_workers=1, max_workers=4)
        self.state = CoordState()
        self.n = 0

    def event(self, t: int, ev) -> None:
        self.n += 1
        self._write(t, decide(self.state, EventInput(f"{self.n}-0", ev), T0 + t, self.spec, epoch=1), ev.kind)

    def tick(self, t: int) -> None:
        self._write(t, decide(self.state, Tick(), T0 + t, self.spec, epoch=1), "tick")

    def _write(self, t: int, d, kind: str) -> None:
        self.state = d.state
        if d.changed:
            entry = control_entry(d, kind=kind, source_id="tick" if kind == "tick" else f"{self.n}-0", now_ms=T0 + t,
                                  epoch=1)
            self.r.xadd(job_keys(self.job).control, entry.to_fields())


def simulate_run(r, job: str) -> None:
    """A run as the coordinator and rank 0 would record it: start with 3 workers, w1 killed
    (0.8 s to the next committed step), w3 joins, w2 drains, completed."""
    c = Coordinator(r, job)
    for i in range(3):
        c.event(i, JoinRequest(job_id=job, host="h", pid=1 + i))
    c.tick(350)  # the joins settled: generation 1
    c.event(400, Ready(job_id=job, worker_id="w0", generation=1))
    step, t = 0, 500
    while t <= 5000:  # 10 steps/s, one entry per 0.5 s
        step += 5
        progress(r, job, t, step, 1, 3)
        t += 500
    c.event(5200, WorkerExited(job_id=job, worker_id="w1", signal=9))  # generation 2
    t = 6000  # first committed step of generation 2: 0.8 s after the failure decision
    while t <= 12000:
        step += 4
        progress(r, job, t, step, 2 if t < 8500 else 3 if t < 12100 else 4, 2 if t < 8500 else 3)
        t += 500
    c.event(8000, JoinRequest(job_id=job, host="h", pid=9))
    c.tick(8350)  # generation 3
    c.event(12100, LeaveRequest(job_id=job, worker_id="w2"))  # generation 4
    c.event(12600, Left(job_id=job, worker_id="w2"))
    t = 12700
    while t <= 15000:
        step += 4
        progress(r, job, t, step, 4, 2)
        t += 500
    c.event(15100, JobCompleted(job_id=job, worker_id="w0", step=step))


def test_report_marks_membership_changes_shades_recovery_and_writes_a_png(r, job_id, tmp_path) -> None:
    simulate_run(r, job_id)
    out = tmp_path / "report.png"
    marks = write_report(r, job_id, out)

    assert [(m.kind, m.generation) for m in marks] == [
        ("start", 1), ("failure", 2), ("join", 3), ("leave", 4), ("end", 4)]
    start, fail, join, leave, end = marks
    assert start.world_size == 3 and start.label == "g1 start →3"
    assert fail.failed == ("w1",) and fail.removed == ("w1",) and fail.label == "g2 w1 failed →2"
    assert fail.recovery_s == 0.8 and fail.gap_end_ms == T0 + 6000 and fail.step == 50
    assert join.joined == ("w3",) and join.label == "g3 w3 joined →3" and join.recovery_s is None
    assert leave.removed == ("w2",) and not leave.failed and leave.label == "g4 w2 left →2"
    assert end.label == "completed" and end.ts_ms == T0 + 15100

    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    from matplotlib.image import imread

    h, w, _ = imread(out).shape
    assert (w, h) == (1400, 900)


def test_pause_and_resume_are_labelled_without_inventing_leaves(r, job_id) -> None:
    c = Coordinator(r, job_id)
    c.spec = c.spec.model_copy(update={"min_workers": 2})
    for i in range(2):
        c.event(i, JoinRequest(job_id=job_id, host="h", pid=1 + i))
    c.tick(350)  # generation 1: w0, w1
    c.event(400, WorkerExited(job_id=job_id, worker_id="w1", exit_code=1))  # generation 2: paused
    c.event(500, JoinRequest(job_id=job_id, host="h", pid=3))
    c.tick(850)  # generation 3: w0, w2
    control = [ControlEntry.from_fields(f) for _sid, f in r.xrange(job_keys(job_id).control)]
    marks = membership_events(control)
    assert [m.label for m in marks] == ["g1 start →2", "g2 w1 failed; paused", "g3 resumed; w2 joined →2"]
    assert marks[1].removed == ("w1",) and marks[2].joined == ("w2",)


def test_progress_recorder_is_rate_limited_records_new_generations_and_never_raises(r, job_id) -> None:
    keys = job_keys(job_id)
    rec = ProgressRecorder(r, keys, interval=0.5)
    wrote = [rec.record(1, 2.0, 1, 2, t=100.0), rec.record(2, 1.9, 1, 2, t=100.2), rec.record(3, 1.8, 1, 2, t=100.6),
             rec.record(4, float("nan"), 2, 1, t=100.7), rec.record(5, None, 2, 1, t=100.8)]
    assert wrote == [True, False, True, True, False]
    entries = [{k.decode(): v.decode() for k, v in f.items()} for _id, f in r.xrange(keys.progress)]
    assert [(e["step"], e["generation"], e["world_size"]) for e in entries] == [("1", "1", "2"), ("3", "1", "2"), ("4", "2", "1")]
    assert entries[0]["loss"] == "2.0" and entries[2]["loss"] == "nan" and entries[0]["t"] == "100.0"

    down = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5, retry=None)
    rec = ProgressRecorder(down, keys, error_backoff=5.0)
    assert rec.record(1, 1.0, 1, 1, t=0.0) is False  # dropped, no exception
    assert rec.record(2, 1.0, 2, 1, t=1.0) is False and rec.dropped == 1  # backing off: not even tried


def test_report_cli_errors_are_one_line(r, redis_url, job_id, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert main(["report", job_id, "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"shoal: no job {job_id!r} in this Redis\n"

    create_job(r, JobSpec(name=job_id, entrypoint="simulate"))
    assert main(["report", job_id, "-o", str(tmp_path / "x.png")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"shoal: job {job_id!r} has no progress history yet") and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()

    simulate_run(r, job_id)
    assert main(["report", job_id, "-o", str(tmp_path / "x.png")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'x.png'}: 4 generation change(s), 1 failure(s)")
    assert "g2 w1 failed →2 (recovered in 0.80 s)" in out


def test_report_counts_committed_steps_from_the_job_record_and_drops_points_after_the_end(r, job_id) -> None:
    """The title's step count is the job's (its completion summary), not the last sampled
    progress point's; a point recorded after the job ended is not drawn (issue 14)."""
    import json as _json

    from shoal.ops.report import load_history

    simulate_run(r, job_id)  # progress sampled up to step 122, completed at T0 + 15100
    progress(r, job_id, 15500, 130, 4, 2)  # a late sample after the end line
    r.hset(job_keys(job_id).state, mapping={"state": "completed", "summary": _json.dumps({"step": 131})})
    h = load_history(r, job_id)
    assert h.committed == 131
    assert max(p.t_ms for p in h.points) <= T0 + 15100 and h.points[-1].step == 122


def test_labels_of_membership_changes_a_few_steps_apart_do_not_print_over_each_other(r, job_id) -> None:
    """Issue 37: "g1 start" and "g2 w1 joined" overprinted when the join came a few steps after
    the start. Each label's box, as the renderer draws it, is clear of every other's."""
    from shoal.ops.report import LABEL_PITCH_PT, analyse, draw, label_positions, load_history

    c = Coordinator(r, job_id)
    c.event(0, JoinRequest(job_id=job_id, host="h", pid=1))
    c.tick(350)  # generation 1: w0
    c.event(600, JoinRequest(job_id=job_id, host="h", pid=2))
    c.tick(950)  # generation 2: w1 joined, 2 steps later
    c.event(1300, WorkerExited(job_id=job_id, worker_id="w1", signal=9))  # generation 3, 2 steps later still
    for i in range(1, 200):
        progress(r, job_id, 100 + 250 * i, 2 * i, 1 if i < 4 else 2 if i < 6 else 3, 1)
    history = load_history(r, job_id)
    marks = analyse(history)
    assert [m.label for m in marks[:3]] == ["g1 start →1", "g2 w1 joined →2", "g3 w1 failed →1"]
    fig = draw(history, marks)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes[:2]:  # the loss panels carry the labels
        labels = [t for t in ax.texts if t.get_text().startswith("g")]
        assert len(labels) == 3
        anchors = [ax.transData.transform((x, 0))[0] for x in
                   ([m.step for m in marks[:3]] if ax is fig.axes[0] else [(m.ts_ms - T0) / 1000 for m in marks[:3]])]
        assert max(anchors) - min(anchors) < 2 * LABEL_PITCH_PT  # close enough to collide unless moved apart
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
    assert label_positions([10.0, 12.0, 13.0, 40.0], 11.0) == [10.0, 21.0, 32.0, 43.0]
