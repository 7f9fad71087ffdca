"""``shoal report`` with evaluations: rank 0's evaluation entries in the progress stream are
drawn against step and time, never past the job's end, and never taken for committed steps."""

from __future__ import annotations

from matplotlib.image import imread

from shoal.events.keys import job_keys
from shoal.events.streams import ProgressEntry
from shoal.ops.report import analyse, load_history, read_progress, write_report
from shoal.worker.progress import ProgressRecorder
from tests.cli.test_report import T0, simulate_run


def test_report_draws_evaluations_and_never_past_the_end_line(r, job_id, tmp_path) -> None:
    # what rank 0's recorder writes (its entry ids are Redis server time: now)
    other = job_keys(job_id + "-rec").progress
    rec = ProgressRecorder(r, job_keys(job_id + "-rec"))
    assert rec.record_eval(20, 0, 2, {"accuracy": 0.5, "loss": 0.5}, t=1.0)
    assert not rec.record_eval(1, 0, 2, {"x": float("nan")})  # refused (JSON holds no NaN), never raises
    ((_id, fields),) = r.xrange(other)
    r.delete(other)
    written = {k.decode(): v.decode() for k, v in fields.items()}
    assert written == {"kind": "eval", "step": "20", "epoch": "0", "generation": "2",
                       "metrics": '{"accuracy":0.5,"loss":0.5}', "t": "1.0"}

    simulate_run(r, job_id)  # progress sampled up to step 122, completed at T0 + 15100
    progress = job_keys(job_id).progress
    entries = [(sid.decode(), fields) for sid, fields in r.xrange(progress)]
    for t, step, epoch, acc in [(2000, 20, 0, 0.5), (9000, 80, 1, 0.7), (9100, 81, 1, None), (15050, 125, 2, 0.9),
                                (15500, 130, 2, 0.95)]:
        metrics = "{oops" if acc is None else f'{{"accuracy": {acc}, "loss": {1 - acc}}}'  # step 81: does not parse
        entries.append((f"{T0 + t}-1", {**written, "step": str(step), "epoch": str(epoch), "metrics": metrics}))
    r.delete(progress)  # the run's history with the evaluations in it, in time order
    for sid, fields in sorted(entries, key=lambda e: tuple(map(int, e[0].split("-")))):
        r.xadd(progress, fields, id=sid)

    h = load_history(r, job_id)
    # step 81 does not parse, step 130 came after the end: neither is drawn
    assert [(e.step, e.epoch, e.metrics["accuracy"]) for e in h.evals] == [(20, 0, 0.5), (80, 1, 0.7), (125, 2, 0.9)]
    assert h.points[-1].step == 122 and all(p.loss == p.loss for p in h.points)  # no evaluation taken for a step
    end = analyse(h)[-1]
    assert end.kind == "end" and end.step == 125  # the final evaluation's step: nothing drawn past the line

    out = tmp_path / "report.png"
    write_report(r, job_id, out)
    h_px, w_px, _ = imread(out).shape
    assert (w_px, h_px) == (1400, 1250)


def test_report_draws_rank_0s_step_time_split(r, job_id, tmp_path) -> None:
    rec = ProgressRecorder(r, job_keys(job_id + "-rec"))
    assert rec.record(7, 1.5, 1, 2, t=1.0, input_wait=0.001, compute=0.0321, exposed_comm=0.004)
    ((_id, fields),) = r.xrange(job_keys(job_id + "-rec").progress)
    r.delete(job_keys(job_id + "-rec").progress)
    written = {k.decode(): v.decode() for k, v in fields.items()}
    assert (written["compute"], written["input_wait"], written["exposed_comm"]) == ("0.0321", "0.001", "0.004")

    simulate_run(r, job_id)
    progress = job_keys(job_id).progress
    entries = [(sid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for sid, f in r.xrange(progress)]
    r.delete(progress)
    for n, (sid, f) in enumerate(entries):  # exposed all-reduce grows when w3 joins; one entry unreadable
        parts = {"compute": "0.030", "input_wait": "0.002",
                 "exposed_comm": "0.009" if int(f["generation"]) >= 3 else "0.003"}
        if n == 5:
            parts["compute"] = "fast"
        r.xadd(progress, {**f, **parts}, id=sid)

    h = load_history(r, job_id)
    assert [p.compute for p in h.points].count(None) == 1 and h.points[5].compute is None
    assert h.points[5].exposed_comm == 0.003 and h.points[-1].exposed_comm == 0.009
    assert all(p.input_wait == 0.002 for p in h.points)
    out = tmp_path / "report.png"
    write_report(r, job_id, out)
    h_px, w_px, _ = imread(out).shape
    assert (w_px, h_px) == (1400, 1250)  # a row for the split

    plain = tmp_path / "plain.png"  # entries without the split (an older worker): no such row
    r.delete(progress)
    for sid, f in entries:
        r.xadd(progress, f, id=sid)
    assert all(p.compute is None for p in load_history(r, job_id).points)
    write_report(r, job_id, plain)
    assert imread(plain).shape[:2] == (900, 1400)


def test_report_draws_a_streaming_datasets_input(r, job_id, tmp_path) -> None:
    rec = ProgressRecorder(r, job_keys(job_id + "-rec"))
    assert rec.record(3, 1.5, 1, 2, t=1.0, stream={"bytes_downloaded": 12345, "cache_hit_rate": 0.5,
                                                   "remote_reads": 7, "shards_owned": 4})
    ((_id, fields),) = r.xrange(job_keys(job_id + "-rec").progress)
    written = {k.decode(): v.decode() for k, v in fields.items()}
    assert (written["downloaded"], written["hit_rate"], written["remote"]) == ("12345", "0.5", "7")
    # the published schema of the progress stream describes every field rank 0 writes
    entry = ProgressEntry.from_fields(written)
    assert entry.to_fields() == written and entry.is_step

    simulate_run(r, job_id)
    progress = job_keys(job_id).progress
    entries = [(sid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for sid, f in r.xrange(progress)]
    r.delete(progress)
    for n, (sid, f) in enumerate(entries):
        parts = {"downloaded": str(1000 * n), "hit_rate": "0.9", "remote": str(n)}
        if n == 2:
            parts["hit_rate"] = "7"  # out of range: left out
        r.xadd(progress, {**f, **parts}, id=sid)
    h = load_history(r, job_id)
    assert [p.downloaded for p in h.points] == [1000 * n for n in range(len(entries))]
    assert h.points[2].hit_rate is None and h.points[3].hit_rate == 0.9
    out = tmp_path / "report.png"
    write_report(r, job_id, out)
    h_px, w_px, _ = imread(out).shape
    assert (w_px, h_px) == (1400, 1250)  # a row for the streaming input


def test_progress_is_read_in_pages_after_an_id(r, job_id) -> None:
    """The dashboard's charts follow a job with ``read_progress(after=..., limit=...)``: each
    page holds at most ``limit`` entries, says whether the stream goes on, and the pages
    together are the whole stream once, evaluations and unknown kinds included in the count."""
    key = job_keys(job_id).progress
    for step in range(1, 24):
        r.xadd(key, {"step": str(step), "loss": "1.0", "generation": "1", "world_size": "2", "t": "0"})
        if step % 10 == 0:
            r.xadd(key, {"kind": "eval", "step": str(step), "epoch": "0", "generation": "1",
                         "metrics": '{"acc": 0.5}', "t": "0"})
    r.xadd(key, {"kind": "future-kind", "step": "24"})
    pages, after = [], "0-0"
    while True:
        points, evals, after, more = read_progress(r, key, after=after, limit=10)
        pages.append(([p.step for p in points], [e.step for e in evals]))
        if not more:
            break
    assert len(pages) == 3  # 26 entries: 10 + 10 + 6
    assert [s for p, _ in pages for s in p] == list(range(1, 24))
    assert [s for _, e in pages for s in e] == [10, 20]
    assert sum(len(p) + len(e) for p, e in pages[:2]) == 20
    assert read_progress(r, key, after=after, limit=10)[:2] == ([], []) and after == r.xrevrange(key, count=1)[0][0].decode()
