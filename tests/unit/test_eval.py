"""Periodic evaluation: when it is due (steps, epochs, short last batches), the worker's
decision to evaluate, the wire event, the coordinator's record of the newest evaluation and
how status, the launch summary and metrics show it. Pure or fakeredis: no processes."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace

import fakeredis
import pytest
import torch

from shoal.coordinator.decide import EventInput, decide as coord_decide
from shoal.coordinator.states import CoordState
from shoal.events.records import Evaluation, JobStatus, WorkerRecord
from shoal.events.states import JobState, WorkerState
from shoal.core.jobspec import JobSpec
from shoal.core.registry import create_job
from shoal.events.keys import job_keys
from shoal.events.models import (
    MAX_EVAL_METRICS,
    EvalReported,
    InvalidEvent,
    JobCompleted,
    Member,
    ShardTable,
    decode_event,
    encode_event,
    finite_metrics,
)
from shoal.worker.data import DataOrder
from shoal.worker.decide import (
    BarrierPolled,
    Beat,
    Committed,
    Evaluate,
    Finish,
    Formed,
    Limits,
    Phase,
    TableFetched,
    Tick,
    TrainerState,
    decide,
    eval_due,
)
T0 = 1000.0


# ---- when an evaluation is due ---------------------------------------------------------------


def test_eval_every_steps_is_due_on_multiples_only() -> None:
    limits = Limits(num_samples=10, eval_every_steps=4)
    due = [k for k in range(0, 25) if eval_due(limits, k, cursor=k * 4)]
    assert due == [4, 8, 12, 16, 20, 24]
    assert not any(eval_due(Limits(num_samples=10), k, k * 4) for k in range(25))  # not asked for


def test_eval_every_epochs_is_due_after_the_last_step_of_an_epoch_even_a_short_one() -> None:
    """10 samples, global batch 4: each epoch is 3 steps (4, 4, then a short batch of 2), so
    epochs end at steps 3, 6, 9 - cursor 10, 20, 30 - which are not multiples of the batch."""
    order = DataOrder(10, seed=0, global_batch=4)
    cursor, ends = 0, []
    for step in range(1, 10):
        cursor = order.batch(cursor).next_cursor
        ends.append((step, cursor))
    every_epoch = Limits(num_samples=10, eval_every_epochs=1)
    assert [s for s, c in ends if eval_due(every_epoch, s, c)] == [3, 6, 9]
    assert [c for s, c in ends if s in (3, 6, 9)] == [10, 20, 30]
    every_second = replace(every_epoch, eval_every_epochs=2)
    assert [s for s, c in ends if eval_due(every_second, s, c)] == [6]
    # by steps, the same job evaluates mid-epoch: epoch boundaries do not matter
    by_steps = Limits(num_samples=10, eval_every_steps=2)
    assert [s for s, c in ends if eval_due(by_steps, s, c)] == [2, 4, 6, 8]
    # the dataset size not known yet: never due by epochs (nothing to count them with)
    assert not eval_due(Limits(eval_every_epochs=1), 3, 10)


# ---- the worker's decision -------------------------------------------------------------------

BATCH = 4


def _table(gen: int, *workers: str) -> ShardTable:
    w = len(workers)
    members = [Member(worker_id=wid, rank=r, ranges=[(r * BATCH // w, (r + 1) * BATCH // w, 1)])
               for r, wid in enumerate(workers)]
    return ShardTable(job_id="j", generation=gen, world_size=w, strategy="contiguous", num_samples=BATCH,
                      members=members)


def _training(limits: Limits, wid: str, step: int = 0, cursor: int = 0) -> TrainerState:
    s = decide(TrainerState(limits, worker_id=wid, step=step, cursor=cursor), Tick(latest=1), T0).state
    s = decide(s, TableFetched(_table(1, "w0", "w1")), T0).state
    s = decide(s, BarrierPolled(arrived=2, newest=1), T0).state
    s = decide(s, Formed(step=step, cursor=cursor), T0).state
    assert s.phase is Phase.TRAINING
    return s


def _commit(s: TrainerState, cursor: int):
    return decide(decide(s, Tick(latest=1), T0).state, Committed(cursor=cursor, max_generation=1), T0)


@pytest.mark.parametrize("wid, rank0", [("w0", True), ("w1", False)])
def test_every_member_evaluates_a_due_step_after_its_beat_and_only_rank0_reports(wid, rank0) -> None:
    limits = Limits(total_samples=30, num_samples=10, eval_every_epochs=1)
    s = _training(limits, wid, step=2, cursor=8)
    d = _commit(s, cursor=10)  # step 3 ends epoch 1 (a short batch)
    assert isinstance(d.actions[-1], Evaluate) and isinstance(d.actions[-2], Beat)
    assert d.actions[-1] == Evaluate(step=3, cursor=10, epoch=1, generation=1, report=rank0)
    assert d.state.evaluated == 3 and "evaluating" in d.reason
    d = _commit(d.state, cursor=14)  # step 4: mid-epoch, not due
    assert not any(isinstance(a, Evaluate) for a in d.actions)


def test_a_step_is_never_evaluated_twice_and_the_final_step_is_evaluated_by_finish_only() -> None:
    limits = Limits(total_samples=16, num_samples=8, eval_every_steps=2)
    s = _training(limits, "w0", step=1, cursor=4)
    d = _commit(s, cursor=8)
    assert [a for a in d.actions if isinstance(a, Evaluate)] == [Evaluate(2, 8, 1, 1, True)]
    # the same step committed again by this worker (never in practice): not evaluated again
    again = decide(decide(replace(d.state, step=1, cursor=4), Tick(latest=1), T0).state,
                   Committed(cursor=8, max_generation=1), T0)
    assert not any(isinstance(a, Evaluate) for a in again.actions)
    d = _commit(d.state, cursor=12)  # step 3: not due
    d = _commit(d.state, cursor=16)  # step 4: due AND the last one: Finish evaluates, once
    assert d.state.phase is Phase.EXITED
    assert not any(isinstance(a, Evaluate) for a in d.actions) and isinstance(d.actions[-1], Finish)


def test_a_due_step_before_a_switch_is_evaluated_before_leaving_the_group() -> None:
    limits = Limits(total_samples=100, num_samples=10, eval_every_steps=1)
    s = _training(limits, "w1")
    d = decide(decide(s, Tick(latest=2), T0).state, Committed(cursor=4, max_generation=2), T0)
    assert isinstance(d.actions[-1], Evaluate) and d.state.switch_to == 2
    assert "switching" in d.reason


# ---- the wire ---------------------------------------------------------------------------------


def test_eval_event_round_trips_and_refuses_values_json_cannot_hold() -> None:
    ev = EvalReported(job_id="j", worker_id="w0", step=40, epoch=1, generation=3, metrics={"accuracy": 0.5}, final=True)
    assert decode_event(encode_event(ev), "j") == ev
    old = {"kind": "eval", "job_id": "j", "worker_id": "w0", "step": 4}  # a minimal writer
    assert decode_event({"data": json.dumps(old)}, "j").metrics == {}
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidEvent, match="eval.metrics"):
            decode_event({"data": json.dumps(old | {"metrics": {"loss": bad}})}, "j")
    with pytest.raises(ValueError):
        EvalReported(job_id="j", step=1, metrics={"x": math.nan})


def test_finite_metrics_keeps_finite_numbers_and_says_what_it_left_out() -> None:
    kept, dropped = finite_metrics({"acc": 1, "loss": torch.tensor(0.25), "nan": math.nan, "inf": -math.inf,
                                    "name": "x", "": 2.0, "n" * 101: 1.0})
    assert kept == {"acc": 1.0, "loss": 0.25}
    assert len(dropped) == 5 and any("'nan'" in d and "not finite" in d for d in dropped)
    many, dropped = finite_metrics({f"m{i}": i for i in range(MAX_EVAL_METRICS + 2)})
    assert len(many) == MAX_EVAL_METRICS and len(dropped) == 2
    assert finite_metrics([1, 2]) == ({}, ["eval_fn returned list, not a dict of name -> number"])
    # what the worker keeps always makes a valid event; one more metric does not
    EvalReported(job_id="j", step=1, metrics=many)
    with pytest.raises(ValueError):
        EvalReported(job_id="j", step=1, metrics={**many, "one more": 1.0})


def test_engine_evaluate_leaves_out_non_finite_metrics_with_a_warning(caplog) -> None:
    from shoal.worker.engine import StepEngine

    model = torch.nn.Linear(2, 1)
    engine = StepEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), [], loss_fn=torch.nn.MSELoss(reduction="sum"),
                        device="cpu", require_group=False)
    seen = {}

    def eval_fn(m):
        seen["training"] = m.training
        return {"ok": 0.5, "bad": float("nan")}

    with caplog.at_level(logging.WARNING, logger="shoal.worker"):
        assert engine.evaluate(eval_fn) == {"ok": 0.5}
    assert seen == {"training": False} and model.training
    assert "'bad': nan is not finite: left out" in caplog.text


# ---- the coordinator --------------------------------------------------------------------------

SPEC = JobSpec(name="j", entrypoint="simulate", min_workers=1, max_workers=2, global_batch_size=8)
MS = 5_000_000


def _running(*states: WorkerState) -> CoordState:
    workers = {f"w{i}": WorkerRecord(worker_id=f"w{i}", state=st, joined_ms=MS) for i, st in enumerate(states)}
    return CoordState(status=JobStatus(state=JobState.RUNNING, generation=3), workers=workers)


def _eval(wid: str = "w0", step: int = 40, generation: int = 3, **kw) -> EventInput:
    return EventInput(f"{MS}-{step}", EvalReported(job_id="j", worker_id=wid, step=step, epoch=kw.pop("epoch", 0),
                                                  generation=generation, metrics=kw.pop("metrics", {"acc": 0.75}), **kw))


def test_the_coordinator_keeps_the_newest_evaluation_in_the_job_record() -> None:
    s = _running(WorkerState.ACTIVE, WorkerState.ACTIVE)
    d = coord_decide(s, _eval(step=40, epoch=1, metrics={"acc": 0.75, "loss": 0.5}), MS, SPEC)
    assert d.changed and d.actions == ()
    assert d.reason == "w0 evaluated step 40 (1 epoch done, generation 3): acc=0.75 loss=0.5"
    assert d.state.status.eval == Evaluation(step=40, epoch=1, generation=3, metrics={"acc": 0.75, "loss": 0.5},
                                             worker_id="w0")
    # stored in the state hash and read back (an older hash without the field reads as none)
    back = JobStatus.from_hash({k.encode(): v.encode() for k, v in d.state.status.to_hash().items()})
    assert back == d.state.status and back.eval.step == 40
    assert JobStatus.from_hash({"state": "running"}).eval is None and JobStatus().eval is None
    # a newer step replaces it; the final one is said so
    d = coord_decide(d.state, _eval(step=60, metrics={"acc": 0.8}, final=True), MS + 1, SPEC)
    assert d.state.status.eval.step == 60 and "final" in d.reason


def test_late_stale_and_unknown_evaluations_change_nothing() -> None:
    s = coord_decide(_running(WorkerState.ACTIVE, WorkerState.FAILED), _eval(step=40, generation=3), MS, SPEC).state
    for inp, why in [(_eval(step=35, generation=2), "from generation 3"),  # a late report of an older generation
                     (_eval("w1", step=50), "it is Failed"),
                     (_eval("w7", step=50), "unknown worker")]:
        d = coord_decide(s, inp, MS + 1, SPEC)
        assert not d.changed and d.state == s and why in d.reason, d.reason
    ended = replace(s, status=replace(s.status, state=JobState.COMPLETED))
    d = coord_decide(ended, _eval(step=50), MS + 1, SPEC)
    assert not d.changed and "already completed" in d.reason
    # a lower step from a newer generation is the job resuming below it: it is the newest
    d = coord_decide(s, _eval(step=20, generation=5), MS + 1, SPEC)
    assert d.changed and d.state.status.eval.step == 20


def test_the_final_evaluation_precedes_the_completion_which_keeps_it() -> None:
    s = _running(WorkerState.ACTIVE)
    s = coord_decide(s, _eval(step=64, metrics={"accuracy": 0.9}, final=True), MS, SPEC).state
    done = coord_decide(s, EventInput(f"{MS}-99", JobCompleted(job_id="j", worker_id="w0", step=64,
                                                                summary={"step": 64, "accuracy": 0.9})), MS + 1, SPEC)
    assert done.state.status.state == JobState.COMPLETED
    assert done.state.status.eval == s.status.eval is not None


# ---- what operators see -----------------------------------------------------------------------


def test_status_launch_summary_and_metrics_show_the_last_evaluation() -> None:
    from shoal.ops.launch import job_summary
    from shoal.ops.metrics import redis_lines
    from shoal.ops.status import format_status, job_status

    r = fakeredis.FakeRedis()
    keys = job_keys("e")
    create_job(r, JobSpec(name="e", entrypoint="simulate"))
    s = job_status(r, "e")
    assert s["eval"] is None and "last evaluation" not in format_status(s)
    doc = {"step": 79, "epoch": 1, "generation": 2, "metrics": {"accuracy": 0.8531, "loss": 0.41}, "worker_id": "w0"}
    r.hset(keys.state, mapping={**JobStatus(state=JobState.RUNNING).to_hash(), "eval": json.dumps(doc)})
    s = job_status(r, "e")
    assert s["eval"] == doc and json.loads(json.dumps(s))["eval"] == doc  # --json
    assert "last evaluation: step 79 (1 epoch done): accuracy=0.8531 loss=0.41" in format_status(s)
    assert job_summary(r, "e")["eval"] == doc
    text = "\n".join(redis_lines(r))
    assert 'shoal_job_eval{job="e",metric="accuracy"} 0.8531' in text
    assert 'shoal_job_eval_step{job="e"} 79' in text and "# TYPE shoal_job_eval gauge" in text


def test_busy_can_be_backdated_to_an_evaluation_before_the_step() -> None:
    """The step after an evaluation is busy from the evaluation's start: the step timeout
    bounds both, which is what a peer waits for in that step's all-reduce."""
    import time

    from shoal.worker.heartbeat import Heartbeater

    r = fakeredis.FakeRedis()
    keys = job_keys("j")
    r.zadd(keys.last_seen, {"w0": 0})
    hb = Heartbeater(r, keys, "w0", interval=0.5, ttl=2.0)
    hb.busy(True, since=time.monotonic() - 3.0)
    assert hb.beat()
    sec, usec = r.time()
    busy_for_ms = sec * 1000 + usec // 1000 - r.zscore(keys.busy, "w0")
    assert 3000 <= busy_for_ms < 4000
    hb.busy(True)  # not backdated: from now
    assert hb.beat() and sec * 1000 + usec // 1000 - r.zscore(keys.busy, "w0") < 1000
