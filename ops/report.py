"""``shoal report JOB -o report.png``: a job's training history as one PNG.

Four panels: loss and throughput (committed steps/s: between each two points, and over the
last 30 s, :func:`shoal.core.throughput.rolling_rates`, with the job's mean samples/s,
tokens/s, FLOP/s and MFU when rank 0 published their figures) against step and against time; two more
below them, the evaluation metrics against step and time, when the job evaluated
(``eval_every_steps``/``eval_every_epochs``, and the final evaluation).
Every new generation is a vertical line with a short label saying why (``w1 failed``,
``w3 joined``, ``w2 left``, ``paused``); the end of the job (completed/stopped/failed) too.
Labels of lines closer than a label's width stand side by side in the lines' order, in their
lines' colours (:func:`label_positions`), so they never print over each other.
The time from a failure decision to the next committed step of a generation at least as new
is a shaded recovery gap.

Sources, both read-only, each through its one model (:mod:`shoal.events.streams`): the
coordinator's ``control`` stream (:class:`~shoal.events.streams.ControlEntry`: time,
generation, job state, and for each new generation the typed membership change: world size,
who joined, who was removed and why) and the ``progress`` stream rank 0
writes (:mod:`shoal.worker.progress`), which also holds each evaluation (``kind`` = ``eval``;
the events stream the coordinator consumes is trimmed once read, so it keeps no history).
Times are Redis server time on both (``ts_ms``; a progress entry's id), so workers' clocks do
not matter. Both streams are capped (~10000 decisions, ~100000 progress entries): a very long
job shows its most recent history only, and its oldest evaluations may be trimmed too.

Rendering uses matplotlib's Agg canvas directly (no pyplot, no display needed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis

from shoal.events.keys import job_keys
from shoal.events.records import JobStatus
from shoal.core.errors import ConfigError, ShoalError
from shoal.core.throughput import WINDOW_S, rolling_rates, throughput
from shoal.ops.jobs import NoSuchJob
from shoal.events.states import JobState, is_terminal
from shoal.events.streams import ControlEntry, ProgressEntry



class NoProgress(ShoalError):
    """The job exists but rank 0 has not recorded any committed step yet."""

    exit_code = 1


@dataclass(frozen=True)
class Point:
    """One progress entry: Redis server time (ms) and what rank 0 had committed then."""

    t_ms: int
    step: int
    loss: float
    generation: int
    world_size: int
    #: rank 0's step time split (seconds; None where the entry has none): data, forward and
    #: backward; the part of it spent waiting for batches; the all-reduce not hidden by backward
    compute: float | None = None
    input_wait: float | None = None
    exposed_comm: float | None = None
    #: a streaming dataset's figures of rank 0 (None where the entry has none): bytes it had
    #: downloaded so far, its cache hit rate (0..1), samples it had read remotely
    downloaded: int | None = None
    hit_rate: float | None = None
    remote: int | None = None
    #: rank 0's throughput figures, on the entries that carry them (None elsewhere): FLOPs of
    #: one sample's forward and backward, its device's peak FLOP/s, tokens in one sample
    flops_per_sample: float | None = None
    peak_flops: float | None = None
    tokens_per_sample: int | None = None


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation rank 0 recorded: Redis server time (ms), the committed step evaluated,
    the epoch the cursor was in after it, and ``eval_fn``'s metrics."""

    t_ms: int
    step: int
    epoch: int
    generation: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class Marked:
    """A vertical line of the report: a new generation, or the end of the job."""

    ts_ms: int
    generation: int
    kind: str  #: start | join | failure | leave | pause | end
    label: str
    reason: str
    joined: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    world_size: int | None = None
    #: the step rank 0 had committed at ts_ms (from the progress history; None before any)
    step: int | None = None
    #: for a failure: seconds to the next committed step of generation >= ``generation``
    #: (None when training never went on); the shaded gap on the time panels
    recovery_s: float | None = None
    #: for a failure: when the shaded gap ends (ms), the end of the history if it never did
    gap_end_ms: int | None = None


@dataclass
class History:
    job_id: str
    points: list[Point] = field(default_factory=list)
    control: list[ControlEntry] = field(default_factory=list)
    state: str = ""
    #: committed steps, from the job's record (the completion summary's step, else the highest
    #: step the coordinator saw), not from the sampled progress points
    committed: int = 0
    #: the evaluations, in the order recorded
    evals: list[EvalPoint] = field(default_factory=list)
    #: the job's global batch (its spec's; None: the spec is gone)
    samples_per_step: int | None = None


# ---- reading -----------------------------------------------------------------------------------


def _xrange_from(client: redis.Redis, key: str, after: str = "0-0",
                 chunk: int = 10_000) -> Iterator[tuple[str, dict]]:
    """The entries of stream ``key`` after id ``after`` (all: ``0-0``), read in chunks of
    ``chunk`` as the caller goes: ``(id, fields)``."""
    start = "(" + after if after != "0-0" else "-"
    while True:
        entries = client.xrange(key, min=start, count=chunk)
        for sid, f in entries:
            yield sid.decode(), f
        if len(entries) < chunk:
            return
        start = "(" + entries[-1][0].decode()


def _point(sid: str, e: ProgressEntry) -> Point:
    return Point(t_ms=int(sid.split("-")[0]), step=e.step, loss=math.nan if e.loss is None else e.loss,
                 generation=e.generation, world_size=e.world_size or 0, compute=e.compute, input_wait=e.input_wait, exposed_comm=e.exposed_comm,
                 downloaded=e.downloaded, hit_rate=e.hit_rate, remote=e.remote, flops_per_sample=e.flops_per_sample,
                 peak_flops=e.peak_flops, tokens_per_sample=e.tokens_per_sample)


def read_progress(client: redis.Redis, key: str, *, after: str = "0-0",
                  limit: int | None = None) -> tuple[list[Point], list[EvalPoint], str, bool]:
    """The committed steps and evaluations of a job's ``progress`` stream (``key``) after entry
    id ``after``: ``(points, evals, last id read, more)``; with ``limit``, at most about that
    many entries are read and ``more`` says whether the stream goes on (read again after the
    last id: how the dashboard's charts follow a job). Entries of kinds this reader does not
    know, and evaluations that do not parse, are skipped."""
    points: list[Point] = []
    evals: list[EvalPoint] = []
    last, read = after, 0
    for sid, f in _xrange_from(client, key, after, chunk=min(limit or 10_000, 10_000)):
        if limit is not None and read >= limit:
            return points, evals, last, True
        last, read = sid, read + 1
        entry = ProgressEntry.from_fields(f)
        if entry.is_eval:
            if entry.metrics is not None:  # one that does not parse is skipped
                evals.append(EvalPoint(t_ms=int(sid.split("-")[0]), step=entry.step, epoch=entry.epoch or 0,
                                       generation=entry.generation, metrics=dict(entry.metrics)))
        elif entry.is_step:
            points.append(_point(sid, entry))
    return points, evals, last, False


def load_history(client: redis.Redis, job_id: str) -> History:
    """Both streams of ``job_id``. ConfigError for an unknown job, NoProgress when rank 0
    has not recorded anything yet."""
    try:
        keys = job_keys(job_id)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    pipe = client.pipeline(transaction=False)
    pipe.exists(keys.spec)
    pipe.exists(keys.control)
    pipe.exists(keys.progress)
    pipe.hmget(keys.state, ["state", "summary", "high_step"])
    pipe.get(keys.spec)
    has_spec, has_control, has_progress, (state, summary, high_step), spec_raw = pipe.execute()
    if not (has_spec or has_control or has_progress):
        raise NoSuchJob(f"no job {job_id!r} in this Redis")
    if not has_progress:
        raise NoProgress(f"job {job_id!r} has no progress history yet (nothing in {keys.progress}: "
                         f"rank 0 records committed steps once training runs)")
    h = History(job_id=job_id, state=state.decode() if state else "", samples_per_step=_global_batch(spec_raw))
    h.points, h.evals, _last, _more = read_progress(client, keys.progress)
    h.control = [ControlEntry.from_fields(f) for _sid, f in _xrange_from(client, keys.control)]
    if not h.state and h.control:
        h.state = h.control[-1].job_state
    end = next((d.ts_ms for d in h.control if is_terminal(d.job_state)), 0)
    if end:  # a point recorded after the job ended (a late sample) is not part of its history
        h.points = [p for p in h.points if p.t_ms <= end] or h.points[:1]
        h.evals = [e for e in h.evals if e.t_ms <= end]
    if not h.points:
        raise NoProgress(f"job {job_id!r} has no committed step in its progress history yet ({keys.progress})")
    record = JobStatus.from_hash({"summary": summary or b"", "high_step": high_step or b"0"})
    done = record.summary.get("step")
    h.committed = done if isinstance(done, int) else max([record.high_step] + [p.step for p in h.points])
    return h


def _global_batch(spec_raw: bytes | None) -> int | None:
    """The stored spec's global batch (None: the spec is gone or does not read)."""
    from shoal.ops.status import stored_spec

    spec = stored_spec(spec_raw)
    return spec.global_batch_size if spec is not None else None


def mean_throughput(history: History) -> dict[str, float] | None:
    """The job's mean rates over its history (steps gained over the time from the first to
    the last point, as :mod:`shoal.core.throughput` counts them): ``steps_per_s``,
    ``samples_per_s`` and, where rank 0 published the figures, ``tokens_per_s``,
    ``flops_per_s``, ``mfu`` (its newest figures; the peak of ``world_size`` devices like
    rank 0's, averaged over the points). None without two points or a global batch."""
    pts = history.points
    if len(pts) < 2 or not history.samples_per_step or pts[-1].t_ms <= pts[0].t_ms:
        return None
    gained = sum(max(0, b.step - a.step) for a, b in zip(pts, pts[1:]))
    rate = gained / ((pts[-1].t_ms - pts[0].t_ms) / 1000)
    newest = lambda attr: next((getattr(p, attr) for p in reversed(pts) if getattr(p, attr)), None)  # noqa: E731
    peak = newest("peak_flops")
    world = sum(p.world_size for p in pts) / len(pts)
    t = throughput(rate, history.samples_per_step, tokens_per_sample=newest("tokens_per_sample"),
                   flops_per_sample=newest("flops_per_sample"), peak_flops=peak * world if peak and world else None)
    out = {"steps_per_s": t.steps_per_s, "samples_per_s": t.samples_per_s}
    out.update({k: v for k, v in (("tokens_per_s", t.tokens_per_s), ("flops_per_s", t.flops_per_s),
                                  ("mfu", t.mfu)) if v is not None})
    return out


# ---- what to mark ------------------------------------------------------------------------------


def _names(ids: tuple[str, ...] | list[str]) -> str:
    return ",".join(ids)


def membership_events(control: list[ControlEntry]) -> list[Marked]:
    """The decisions that planned a new generation (in order), then the job's end if any,
    from the control entries' typed membership fields (who joined, who was removed and why,
    the world size); the reasons are only carried along for people."""
    marks: list[Marked] = []
    generation = 0
    was_paused = False
    ended = False
    for d in control:
        if d.planned and d.generation > generation:
            failed, left, joined = d.failed, d.left, d.joined
            parts = ["resumed"] if was_paused and not d.paused else []
            if failed:
                parts.append(f"{_names(failed)} failed")
            if left:
                parts.append(f"{_names(left)} left")
            if joined and generation > 0:
                parts.append(f"{_names(joined)} joined")
            if failed:
                kind = "failure"
            elif left:
                kind = "leave"
            elif generation == 0 and not d.paused:
                kind, parts = "start", ["start"]
            elif joined:
                kind = "join"
            elif d.paused:
                kind = "pause"
            else:
                kind, parts = "join", parts or ["replanned"]
            if d.paused:
                parts.append("paused")
            world = d.world_size or None
            label = f"g{d.generation} " + "; ".join(parts) + (f" →{world}" if world else "")
            marks.append(Marked(ts_ms=d.ts_ms, generation=d.generation, kind=kind, label=label, reason=d.reason,
                                joined=d.joined, removed=d.removed, failed=failed,
                                world_size=d.world_size if not d.paused else 0))
            generation, was_paused = d.generation, d.paused
        if is_terminal(d.job_state) and not ended:
            ended = True
            marks.append(Marked(ts_ms=d.ts_ms, generation=max(d.generation, generation), kind="end",
                                label="job failed" if d.job_state == JobState.FAILED else str(d.job_state), reason=d.reason))
    return marks


def _with_steps_and_gaps(marks: list[Marked], points: list[Point]) -> list[Marked]:
    """Each mark's committed step at its time; each failure's recovery gap."""
    from bisect import bisect_right

    times = [p.t_ms for p in points]
    end_ms = max([times[-1]] + [m.ts_ms for m in marks]) if times else 0
    out = []
    for m in marks:
        i = bisect_right(times, m.ts_ms)
        step = points[i - 1].step if i > 0 else None
        recovery = gap_end = None
        if m.kind == "failure":
            nxt = next((p for p in points[i:] if p.generation >= m.generation and p.t_ms >= m.ts_ms), None)
            if nxt is not None:
                recovery, gap_end = (nxt.t_ms - m.ts_ms) / 1000.0, nxt.t_ms
            else:
                gap_end = end_ms
        out.append(replace(m, step=step, recovery_s=recovery, gap_end_ms=gap_end))
    return out


def analyse(history: History) -> list[Marked]:
    """The marked events of a history, with steps and recovery gaps filled in. The end of the
    job stands at the last committed step seen by then: the newest sampled progress point's,
    or an evaluation's after it (the final one is of the last step), so no point drawn lies
    past that line."""
    marks = _with_steps_and_gaps(membership_events(history.control), history.points)
    out = []
    for m in marks:
        if m.kind == "end":
            evaluated = [e.step for e in history.evals if e.t_ms <= m.ts_ms]
            if evaluated and max(evaluated) > (m.step or 0):
                m = replace(m, step=max(evaluated))
        out.append(m)
    return out


# ---- drawing -----------------------------------------------------------------------------------

_COLOURS = {"start": "#2b8a3e", "join": "#2b8a3e", "failure": "#c92a2a", "leave": "#e67700",
            "pause": "#868e96", "end": "#212529"}
_STYLES = {"start": ":", "join": "--", "failure": "-", "leave": "--", "pause": ":", "end": "-."}


def _rates(points: list[Point]) -> list[float]:
    """Committed steps/s between each point and the previous one (NaN for the first, or when
    the step went backwards, e.g. after a resume from an older checkpoint)."""
    out = [math.nan]
    for a, b in zip(points, points[1:]):
        dt = (b.t_ms - a.t_ms) / 1000.0
        ds = b.step - a.step
        out.append(ds / dt if dt > 0 and ds >= 0 else math.nan)
    return out


#: Metrics drawn per evaluation panel (the first ones the job reported): more is unreadable.
MAX_EVAL_LINES = 8


def render(history: History, marks: list[Marked], path: str | Path) -> Path:
    """Draw the report (:func:`draw`) into ``path`` (PNG)."""
    fig = draw(history, marks)
    out = Path(path)
    try:
        fig.savefig(out, format="png")
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def draw(history: History, marks: list[Marked]):
    """The report as a matplotlib ``Figure`` (Agg canvas): the four panels (1400x900 px);
    with evaluations, two more below them, with rank 0's step time split two more, and with
    a streaming dataset's input two more (each row adds 350 px)."""
    # matplotlib's first import builds a font cache and says so at INFO: not news for the user
    logging.getLogger("matplotlib").setLevel(max(logging.WARNING, logging.getLogger("matplotlib").level))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    pts = history.points
    t0 = min([pts[0].t_ms] + [m.ts_ms for m in marks])
    secs = [(p.t_ms - t0) / 1000.0 for p in pts]
    steps = [p.step for p in pts]
    losses = [p.loss for p in pts]
    rates = _rates(pts)
    windowed = [math.nan if r is None else r for r in rolling_rates([(p.t_ms / 1000, p.step) for p in pts])]

    evals = history.evals
    split = any(p.compute is not None for p in pts)
    streaming = any(p.downloaded is not None for p in pts)
    rows = 2 + bool(evals) + split + streaming
    fig = Figure(figsize=(14, 9 + 3.5 * (rows - 2)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2, sharex="col")
    (loss_step, loss_time), (rate_step, rate_time) = axes[0], axes[1]
    bottom = axes[-1]
    for ax, x, y in ((loss_step, steps, losses), (loss_time, secs, losses)):
        ax.plot(x, y, color="#1864ab", linewidth=1.2, marker="." if len(pts) < 200 else None, markersize=3)
        ax.grid(True, alpha=0.3)
    for ax, x in ((rate_step, steps), (rate_time, secs)):
        ax.plot(x, rates, color="#74c0fc", linewidth=0.8, marker="." if len(pts) < 200 else None, markersize=2,
                label="between points")
        ax.plot(x, windowed, color="#1864ab", linewidth=1.6, label=f"over the last {WINDOW_S:g} s")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    rate_step.legend(fontsize=8, loc="lower left")
    mean = mean_throughput(history)
    if mean:
        rate_time.annotate(_mean_text(mean), xy=(0.01, 0.03), xycoords="axes fraction", fontsize=8,
                           color="#1864ab", va="bottom", ha="left")
    loss_step.set_ylabel("loss (global batch mean)")
    rate_step.set_ylabel("throughput (committed steps/s)")
    bottom[0].set_xlabel("step")
    bottom[1].set_xlabel("time since start (s)")
    panels = [(loss_step, loss_time), (rate_step, rate_time)]
    if evals:
        panels.append(_draw_evals(evals, t0, axes[2]))
    if split:
        panels.append(_draw_split(pts, t0, axes[2 + bool(evals)]))
    if streaming:
        panels.append(_draw_stream(pts, t0, bottom))
    loss_step.set_title("against step")
    loss_time.set_title("against time")
    if any(v > 0 for v in losses if not math.isnan(v)) and _spread(losses) > 20:
        for ax in (loss_step, loss_time):
            ax.set_yscale("log")

    x_steps = [m.step if m.step is not None else (steps[0] if steps else 0) for m in marks]
    x_times = [(m.ts_ms - t0) / 1000.0 for m in marks]
    for m, x_step, x_time in zip(marks, x_steps, x_times):
        colour, style = _COLOURS[m.kind], _STYLES[m.kind]
        for by_step, by_time in panels:
            for ax, x in ((by_step, x_step), (by_time, x_time)):
                ax.axvline(x, color=colour, linestyle=style, linewidth=1.1, alpha=0.85)
        if m.kind == "failure" and m.gap_end_ms is not None:
            x_end = (m.gap_end_ms - t0) / 1000.0
            for ax in (loss_time, rate_time):
                ax.axvspan(x_time, x_end, color=_COLOURS["failure"], alpha=0.15, linewidth=0)
            if m.recovery_s is not None:
                rate_time.annotate(f"{m.recovery_s:.2f} s", xy=(x_end, 0.97), xycoords=("data", "axes fraction"),
                                   xytext=(2, 0), textcoords="offset points", ha="left", va="top", fontsize=8,
                                   color=_COLOURS["failure"])

    failures = [m for m in marks if m.kind == "failure"]
    rec = [m.recovery_s for m in failures if m.recovery_s is not None]
    gens = max([p.generation for p in pts] + [m.generation for m in marks])
    title = (f"shoal job {history.job_id}: {history.state or 'unknown state'}, "
             f"{history.committed or steps[-1]} steps committed, "
             f"{gens} generation(s), {len(failures)} failure(s)")
    if rec:
        title += f", recovery {rec[0]:.2f} s" if len(rec) == 1 else f", recovery {min(rec):.2f}–{max(rec):.2f} s"
    fig.suptitle(title, fontsize=12)
    handles = [Line2D([], [], color=_COLOURS[k], linestyle=_STYLES[k], label=lbl) for k, lbl in
               (("join", "joined / start"), ("failure", "failure"), ("leave", "left (drained)"),
                ("pause", "paused"), ("end", "job ended"))
               if any(m.kind == k or (k == "join" and m.kind == "start") for m in marks)]
    if failures:
        handles.append(Patch(color=_COLOURS["failure"], alpha=0.15, label="recovery: failure → next committed step"))
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9, frameon=False)
    fig.draw_without_rendering()  # the layout, so that data coordinates map to final pixels
    for ax, xs in ((loss_step, x_steps), (loss_time, x_times)):
        _label_marks(ax, marks, xs)
    return fig


#: Font size of the marks' labels (points), and the room one rotated label takes across.
LABEL_FONT = 8
LABEL_PITCH_PT = LABEL_FONT * 1.35


def label_positions(xs: list[float], pitch: float) -> list[float]:
    """Where labels anchored at ``xs`` (display units, in the marks' order) stand so that no
    two are closer than ``pitch``: each at its own x, or right after the one before it when
    that is nearer (a run of close marks becomes a row of labels, in order)."""
    out: list[float] = []
    for x in xs:
        out.append(x if not out or x >= out[-1] + pitch else out[-1] + pitch)
    return out


def _label_marks(ax, marks: list[Marked], xs: list[float]) -> None:
    """Each mark's label at the top of ``ax``, rotated, in its line's colour, at
    :func:`label_positions`."""
    dpi = ax.figure.dpi
    to_px = ax.transData.transform
    at = [float(to_px((x, 0))[0]) for x in xs]
    order = sorted(range(len(xs)), key=lambda i: at[i])
    pitch = LABEL_PITCH_PT * dpi / 72
    placed = label_positions([at[i] for i in order], pitch)
    for i, x_px in zip(order, placed):
        m, shift = marks[i], (x_px - at[i]) * 72 / dpi  # points
        colour = _COLOURS[m.kind]
        label = ax.annotate(m.label, xy=(xs[i], 1.0), xycoords=("data", "axes fraction"), xytext=(2 + shift, -4),
                            textcoords="offset points", rotation=90, va="top", ha="left", fontsize=LABEL_FONT,
                            color=colour)
        label.set_in_layout(False)  # placed on the final layout: saving must not move the axes


def _mean_text(mean: dict[str, float]) -> str:
    from shoal.ops.status import si

    parts = [f"mean {mean['steps_per_s']:.3g} steps/s", f"{si(mean['samples_per_s'])} samples/s"]
    if "tokens_per_s" in mean:
        parts.append(f"{si(mean['tokens_per_s'])} tokens/s")
    if "flops_per_s" in mean:
        parts.append(f"{si(mean['flops_per_s'], 'FLOP')}/s")
    if "mfu" in mean:
        parts.append(f"MFU {mean['mfu'] * 100:.3g} %")
    return ", ".join(parts)


def _draw_evals(evals: list[EvalPoint], t0: int, axes) -> tuple:
    """The evaluation panels: each metric (the first :data:`MAX_EVAL_LINES` names) against
    step and against time, one marker per evaluation."""
    names = list(dict.fromkeys(name for e in evals for name in e.metrics))[:MAX_EVAL_LINES]
    by_step, by_time = axes
    for name in names:
        pts = [e for e in evals if name in e.metrics]
        values = [e.metrics[name] for e in pts]
        by_step.plot([e.step for e in pts], values, marker="o", markersize=3, linewidth=1.2, label=name)
        by_time.plot([(e.t_ms - t0) / 1000.0 for e in pts], values, marker="o", markersize=3, linewidth=1.2, label=name)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    by_step.set_ylabel("evaluation (eval_fn)")
    if names:
        by_step.legend(fontsize=8, loc="best")
    return by_step, by_time


def _draw_stream(pts: list[Point], t0: int, axes) -> tuple:
    """A streaming dataset's input on rank 0 against step and time: MB downloaded so far and
    samples read remotely so far (left axis), cache hit rate in % (right axis)."""
    by_step, by_time = axes
    shown = [p for p in pts if p.downloaded is not None]
    for ax, xs in ((by_step, [p.step for p in shown]), (by_time, [(p.t_ms - t0) / 1000.0 for p in shown])):
        ax.plot(xs, [p.downloaded / 1e6 for p in shown], color="#2b8a3e", linewidth=1.2, label="MB downloaded")
        remote = [(x, p.remote) for x, p in zip(xs, shown) if p.remote is not None]
        if remote:
            ax.plot([x for x, _ in remote], [v / 1000 for _, v in remote], color="#862e9c", linewidth=1.1,
                    label="remote samples (thousands)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        rate = [(x, p.hit_rate) for x, p in zip(xs, shown) if p.hit_rate is not None]
        if rate:
            twin = ax.twinx()
            twin.plot([x for x, _ in rate], [v * 100 for _, v in rate], color="#e8590c", linewidth=1.0,
                      linestyle="--", label="cache hit rate (%)")
            twin.set_ylim(0, 105)
            if ax is by_time:
                twin.set_ylabel("cache hit rate (%)")
    by_step.set_ylabel("rank 0 streaming input")
    by_step.legend(fontsize=8, loc="upper left")
    return by_step, by_time


def _draw_split(pts: list[Point], t0: int, axes) -> tuple:
    """Rank 0's step time split (ms) against step and time: compute (data, forward, backward),
    the input wait within it, and the all-reduce not hidden by backward."""
    by_step, by_time = axes
    for attr, label, colour in (("compute", "compute (data, forward, backward)", "#1864ab"),
                                ("input_wait", "input wait (within compute)", "#e8590c"),
                                ("exposed_comm", "all-reduce not hidden by backward", "#c92a2a")):
        shown = [p for p in pts if getattr(p, attr) is not None]
        if not shown:
            continue
        ms = [getattr(p, attr) * 1000 for p in shown]
        marker = "." if len(shown) < 200 else None
        by_step.plot([p.step for p in shown], ms, color=colour, linewidth=1.1, marker=marker, markersize=3, label=label)
        by_time.plot([(p.t_ms - t0) / 1000.0 for p in shown], ms, color=colour, linewidth=1.1, marker=marker,
                     markersize=3)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    by_step.set_ylabel("rank 0 step time (ms)")
    by_step.legend(fontsize=8, loc="best")
    return by_step, by_time


def _spread(values: list[float]) -> float:
    pos = [v for v in values if not math.isnan(v) and v > 0]
    return max(pos) / min(pos) if pos else 0.0


def write_report(client: redis.Redis, job_id: str, path: str | Path) -> list[Marked]:
    """Read ``job_id``'s history, draw it into ``path`` and return the marked events."""
    out = Path(path)
    if out.parent and not out.parent.is_dir():
        raise ConfigError(f"cannot write {out}: no directory {out.parent}")
    history = load_history(client, job_id)
    marks = analyse(history)
    render(history, marks, out)
    return marks
