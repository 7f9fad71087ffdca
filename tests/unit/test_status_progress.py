"""``shoal status``: progress people expect (step of total, epoch, percentage, steps/s, ETA),
from the Active members' heartbeats; and members of an ended job are not shown Active."""

from __future__ import annotations

import fakeredis

from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import Heartbeat
from shoal.events.records import WorkerRecord
from shoal.events.states import WorkerState
from shoal.ops.status import _progress, format_status, job_status


def test_progress_of_an_epoch_based_job_has_total_epoch_percentage_rate_and_eta() -> None:
    beats = [Heartbeat(worker_id="w0", step=150, step_time=0.5, total_steps=400, epoch=1),
             Heartbeat(worker_id="w1", step=149, step_time=0.25, total_steps=400, epoch=1)]
    none = {"samples_per_s": None, "tokens_per_s": None, "flops_per_s": None, "mfu": None, "rate_window_s": None}
    p = _progress(beats, high_step=100, ended=False)  # no progress history: the median member's step time
    assert p == {"step": 150, "total_steps": 400, "epoch": 2, "percent": 37.5, "steps_per_s": 2.0, "eta_s": 125.0,
                 **none}
    ended = _progress(beats, high_step=400, ended=True)
    assert ended["percent"] == 100.0 and ended["steps_per_s"] is None and ended["eta_s"] is None
    assert _progress([], high_step=7, ended=False) == {"step": 7, "total_steps": None, "epoch": None,
                                                       "percent": None, "steps_per_s": None, "eta_s": None, **none}


def test_status_shows_progress_and_an_ended_jobs_members_as_ended() -> None:
    r = fakeredis.FakeRedis()
    keys = job_keys("p")
    create_job(r, JobSpec(name="p", entrypoint="simulate"))
    r.hset(keys.workers, "w0", WorkerRecord("w0", WorkerState.ACTIVE, pid=5).to_json())
    r.zadd(keys.last_seen, {"w0": 1})
    r.set(keys.heartbeat("w0"), Heartbeat(worker_id="w0", step=30, step_time=0.1, total_steps=120,
                                          epoch=0).model_dump_json())
    r.hset(keys.state, mapping={"state": "running", "generation": "1"})
    s = job_status(r, "p")
    assert s["workers"][0]["state"] == "Active"
    assert s["progress"]["percent"] == 25.0 and s["progress"]["eta_s"] == 9.0
    text = format_status(s)
    assert "step 30/120 (25 %)  epoch 1  10 steps/s  640 samples/s  ETA 9s" in text
    # each worker's pid in the text table too (issue 37: it was in --json only)
    header, row = text.splitlines()[-2:]
    assert header.split()[:7] == ["worker", "state", "rank", "step", "loss", "hb", "age"] and header.split()[7] == "pid"
    assert row.split()[0] == "w0" and row.split()[6] == "5"  # worker state rank step loss age pid
    r.hset(keys.state, "state", "completed")
    s = job_status(r, "p")
    assert s["workers"][0]["state"] == "Ended" and s["workers"][0]["heartbeat_age_ms"] is None


def test_every_cli_option_and_argument_has_help_text() -> None:
    import argparse

    from shoal.ops.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(a, (argparse._HelpAction, argparse._VersionAction)) and not a.help:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")

    walk(build_parser(), "shoal")
    assert not missing, missing


def test_a_running_job_that_has_not_committed_for_a_few_step_times_shows_no_rate_and_no_eta() -> None:
    """Issue 34: the members' own step timers said "8.9 steps/s, ETA 0.1 s" for a job that had
    not committed for minutes. Each heartbeat says how long before its beat its worker last
    committed; the job's last commit is the newest of those, on Redis's clock."""
    r = fakeredis.FakeRedis()
    keys = job_keys("p")
    create_job(r, JobSpec(name="p", entrypoint="simulate", heartbeat_interval=0.5))
    sec, usec = r.time()
    now = int(sec) * 1000 + int(usec) // 1000
    for w in ("w0", "w1"):
        r.hset(keys.workers, w, WorkerRecord(w, WorkerState.ACTIVE, pid=5).to_json())
        r.zadd(keys.last_seen, {w: now - 100})
    r.hset(keys.state, mapping={"state": "running", "generation": "9"})

    def beat(w: str, since: float) -> None:
        r.set(keys.heartbeat(w), Heartbeat(worker_id=w, step=80, step_time=0.11, total_steps=300,
                                           since_commit=since).model_dump_json())

    beat("w0", 0.2)
    beat("w1", 0.3)  # committed just now: a rate and an ETA
    s = job_status(r, "p")
    assert not s["no_commit"] and s["progress"]["eta_s"] is not None and s["last_commit_age_s"] < 1.0
    beat("w0", 40.0)
    beat("w1", 41.0)  # nothing for 40 s, whatever the step timers say
    s = job_status(r, "p")
    assert s["no_commit"] and s["progress"]["steps_per_s"] is None and s["progress"]["eta_s"] is None
    assert 40.0 <= s["last_commit_age_s"] <= 41.0
    text = format_status(s)
    assert "no commit for 40s" in text and "ETA" not in text and "steps/s" not in text
    # an ended job shows neither
    r.hset(keys.state, "state", "completed")
    s = job_status(r, "p")
    assert not s["no_commit"] and s["last_commit_age_s"] is None
