"""What ``shoal status`` shows: read-only view of a job assembled from its keys.

Ages are computed against Redis server time, like failure detection. Nothing here writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import redis
from pydantic import ValidationError

from shoal.coordinator.decide import format_metrics
from shoal.events.records import JobStatus, WorkerRecord
from shoal.events.keys import JobKeys, job_keys
from shoal.events.models import Heartbeat, ShardTable
from shoal.events.streams import ProgressEntry
from shoal.core.errors import ShoalError
from shoal.core.jobspec import JobSpec
from shoal.core.throughput import WINDOW_S, Rate, throughput, window_rate
from shoal.core.yamlfile import escape_controls
from shoal.ops.jobs import NoSuchJob
from shoal.events.states import LIVE, TERMINAL_JOB_STATES, WorkerState


def parse_heartbeat(raw: bytes | None) -> Heartbeat | None:
    """A heartbeat value through its model; None when absent or not a heartbeat (a
    malformed value shows as no heartbeat rather than breaking ``status``)."""
    if not raw:
        return None
    try:
        return Heartbeat.model_validate_json(raw)
    except ValidationError:
        return None


#: Lines of the first failure's traceback ``shoal status`` prints (``--json`` has all of it).
TRACEBACK_LINES = 12


def job_status(client: redis.Redis, job_id: str, *, window_s: float = WINDOW_S) -> dict:
    """A JSON-able dict: job state, generation, reason, first failure, committed steps redone
    (lost with every replica that held them), the leading coordinator replica (its name,
    never its lease token) and fencing epoch, the entrypoint's ``params``, and per worker id,
    state, step, last heartbeat age (ms), straggler flag, digest, ranges, pid.

    Its ``progress`` has steps/s, samples/s, tokens/s, FLOP/s and MFU over the last
    ``window_s`` seconds of committed steps (:func:`recent_steps`,
    :mod:`shoal.core.throughput`) and the ETA at that rate; ``throughput`` the figures they
    come from (FLOPs per sample, the members' peak FLOP/s, tokens per sample, global batch)."""
    keys = job_keys(job_id)
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.spec)
    pipe.hgetall(keys.state)
    pipe.hgetall(keys.workers)
    pipe.zrange(keys.last_seen, 0, -1, withscores=True)
    pipe.get(keys.shard)
    pipe.time()
    pipe.xlen(keys.dead)
    pipe.get(keys.lease)
    pipe.get(keys.epoch)
    pipe.xlen(keys.failures)
    spec_raw, state_raw, workers_raw, seen, shard_raw, (sec, usec), dead, lease, epoch, failures = pipe.execute()
    if spec_raw is None:
        raise NoSuchJob(f"no job {job_id!r} in this Redis")
    now_ms = int(sec) * 1000 + int(usec) // 1000
    status = JobStatus.from_hash(state_raw)
    last_seen = {w.decode(): int(s) for w, s in seen}
    table = ShardTable.model_validate_json(shard_raw) if shard_raw else None
    records = {wid.decode(): WorkerRecord.from_json(raw) for wid, raw in workers_raw.items()}
    hb_keys = [keys.heartbeat(w) for w in records]
    hbs = client.mget(hb_keys) if hb_keys else []
    workers = []
    ended = status.state in TERMINAL_JOB_STATES
    beats = []
    for (wid, rec), hb_raw in sorted(zip(records.items(), hbs), key=lambda x: (len(x[0][0]), x[0][0])):
        hb = parse_heartbeat(hb_raw)
        if hb is not None and rec.state == WorkerState.ACTIVE:
            beats.append(hb)
        member = table.member(wid) if table else None
        live = rec.state in LIVE
        workers.append({
            "worker_id": wid,
            # a member when the job ended is not still Active: its process is gone or going
            "state": "Ended" if ended and live else rec.state.value,
            "rank": member.rank if member else None,
            # elastic HSDP: its replica group and shard index (None: data parallelism)
            "replica_group": member.group if member and table.shard_size > 1 else None,
            "shard": member.shard if member and table.shard_size > 1 else None,
            "peak_rss_mb": hb.peak_rss_mb if hb else None,
            "step": hb.step if hb else None,
            "loss": hb.loss if hb else None,
            "step_time": hb.step_time if hb else None,
            # seconds its last committed step waited for its batches (the input pipeline's lag)
            "input_wait_time": hb.input_wait_time if hb else None,
            # its last committed step's own work, and the all-reduce time backward did not hide
            "compute_time": hb.compute_time if hb else None,
            "exposed_comm_time": hb.exposed_comm_time if hb else None,
            # a streaming dataset's input: bytes downloaded, cache hit rate, shards owned,
            # samples read remotely, the last step's balance error (None: not streaming)
            **{f: getattr(hb, f) if hb else None for f in STREAM_FIELDS},
            "digest": hb.digest if hb else None,
            # a compiled model: dynamo's frames, those after the warm-up (recompiles), warm-up s
            "compiled_frames": hb.compiled_frames if hb else None,
            "recompiles": hb.recompiles if hb else None,
            "compile_seconds": hb.compile_seconds if hb else None,
            "heartbeat_age_ms": (now_ms - last_seen[wid]) if wid in last_seen and not ended else None,
            "straggler": rec.straggler,
            "host": rec.host,
            "pid": rec.pid,
            # where it trains: the group backend, its model's device, its GPU as the node names it
            "backend": rec.backend or None,
            "device": rec.device or None,
            "gpu": rec.gpu or None,
            "placement": rec.placement or None,
            "reason": rec.reason,
            "ranges": [list(r) for r in member.ranges] if member else [],
        })
    since_commit = last_commit_age(records, hbs, last_seen, now_ms)
    if since_commit is None and status.high_step_ms and status.high_step:  # no live member committed yet (all restarted)
        since_commit = max(0.0, (now_ms - status.high_step_ms) / 1000)
    # the watchdog counts a churn: the same members re-planned after failures of one step
    churning = status.stall.step >= 0 and status.stall.generations >= CHURN_GENERATIONS
    stalled = (not ended and since_commit is not None
               and since_commit > (CHURN_FLOOR_S if churning else
                                   no_commit_threshold(beats, _heartbeat_interval(spec_raw))))
    points, entry = recent_steps(client, keys, window_s)
    figures = _figures(beats, entry, spec_raw)
    return {
        "job_id": job_id,
        "state": status.state.value,
        "progress": _progress(beats, max(status.high_step, _summary_step(status.summary)), ended or stalled,
                              completed=status.state.value == "completed", window=window_rate(points, window_s),
                              figures=figures),
        # what the rates come from; window_s: the seconds they are measured over at most
        "throughput": {**figures, "window_s": window_s},
        # seconds since the newest committed step any member reported (None: none yet, or ended),
        # and whether that is longer than a few step times: then no rate or ETA is shown
        "last_commit_age_s": None if ended or since_commit is None else round(since_commit, 1),
        "no_commit": stalled,
        # the progress watchdog's spell (coordinator/watchdog.py): the step that keeps failing,
        # in how many generations of the same members, who reported it (None: none)
        "stall": ({"step": status.stall.step, "generations": status.stall.generations,
                   "reporters": dict(status.stall.reporters), "restarts": status.stall.restarts,
                   "last_error": status.stall.error} if churning and not ended else None),
        # the keyword arguments of the entrypoint (the spec's ``params``; {} : none)
        "params": _spec_params(spec_raw),
        "generation": status.generation,
        "world_size": table.world_size if table else 0,
        "shard_size": table.shard_size if table else 1,
        "reason": status.reason,
        "first_failure": status.first_failure,
        "first_failure_traceback": status.first_failure_traceback,
        "failures": int(failures),
        "steps_redone": status.steps_redone,
        # the newest evaluation: step, epoch (complete), generation, metrics, worker_id (None: none)
        "eval": _evaluation(status),
        # generations of the same members that could not form, in a row (None: the newest formed)
        "formation": ({"failures": formed.failures, "last_error": formed.rendezvous_error,
                       "configuration_error": formed.config_error or None,
                       "strikes": formed.strikes,
                       "retry_in_ms": max(0, formed.retry_ms - now_ms) if formed.retry_ms else None}
                      if (formed := status.formation).failures and not ended else None),
        "rejected_joins": status.rejected_joins,
        "last_rejection": status.last_rejection,
        "dead_letters": int(dead),
        # the lease value is "<replica name>:<secret-ish token>": show only the name
        "leader": lease.decode(errors="replace").split(":")[0] if lease else None,
        "epoch": int(epoch or 0),
        "workers": workers,
    }


def job_summary(client: redis.Redis, job_id: str, *, steps: int = 0) -> dict:
    """What a launch unit returns (its RQ result) and the HTTP API's ``/jobs/{id}/summary``:
    state, reason, generation, steps (the completion summary's, else the highest committed
    step seen: ``steps`` or the job record's), committed steps redone (lost with every replica
    that held them: the job resumed from a checkpoint or from scratch), the summary the job's
    rank 0 reported at completion (``summary`` in the state hash, JSON) and its newest
    evaluation (``eval``: step, epoch, generation, metrics; None when it has none)."""
    raw = client.hgetall(job_keys(job_id).state)
    status = JobStatus.from_hash(raw)
    summary = dict(status.summary) or None
    if summary is not None and isinstance(summary.get("step"), int):
        steps = summary["step"]
    else:
        steps = max(steps, status.high_step)
    return {
        "job_id": job_id,
        "state": status.state.value,
        "reason": status.reason if raw else "",
        "generation": status.generation,
        "steps": steps,
        "steps_redone": status.steps_redone,
        "summary": summary,
        "eval": _evaluation(status),
    }


def jobs_overview(client: redis.Redis) -> list[dict]:
    """One line per registered job (``shoal jobs``, the HTTP API's ``GET /jobs``): job id,
    state, generation, world size, step, total steps, percent, steps/s, samples/s, tokens/s,
    MFU (as ``job_status`` measures them), workers Active; a
    job whose records do not read shows its id, state ``unknown`` and the one-line ``error``."""
    from shoal.core.registry import list_jobs

    out = []
    for jid in list_jobs(client):
        try:
            s = job_status(client, jid)
        except (ShoalError, ValidationError, ValueError) as exc:
            out.append({"job_id": jid, "state": "unknown", "error": escape_controls(str(exc).splitlines()[0])})
            continue
        p = s["progress"]
        out.append({"job_id": jid, "state": s["state"], "generation": s["generation"], "world_size": s["world_size"],
                    "step": p["step"], "total_steps": p["total_steps"], "percent": p["percent"],
                    "steps_per_s": p["steps_per_s"], "samples_per_s": p["samples_per_s"],
                    "tokens_per_s": p["tokens_per_s"], "mfu": p["mfu"], "reason": s["reason"],
                    "active": sum(1 for w in s["workers"] if w["state"] == WorkerState.ACTIVE)})
    return out


def _summary_step(summary: dict) -> int:
    """The step of a completion summary (0 when it has none)."""
    step = summary.get("step", 0)
    return step if isinstance(step, int) else 0


def _evaluation(status: JobStatus) -> dict | None:
    """The job's newest evaluation as JSON values: ``step``, ``epoch``, ``generation``,
    ``metrics``, ``worker_id``; None when it has none."""
    return asdict(status.eval) if status.eval is not None else None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


#: A running job shows "no commit for N s" (and no steps/s or ETA) once its newest commit is
#: older than this many of its median step time, and at least NO_COMMIT_FLOOR_S and two
#: heartbeat intervals (a beat reports its worker's last commit up to an interval late).
NO_COMMIT_STEPS = 5
NO_COMMIT_FLOOR_S = 5.0
#: ... or, while the progress watchdog counts this many generations of the same members re-
#: planned after failures of one step (``JobStatus.stall``), once it is older than a second.
CHURN_GENERATIONS = 2
CHURN_FLOOR_S = 1.0


def last_commit_age(records: dict[str, WorkerRecord], beats_raw: list, last_seen: dict[str, int],
                    now_ms: int) -> float | None:
    """Seconds since the newest committed step of any live member, on Redis's clock: each
    heartbeat says how long before its beat (``last_seen``) its worker last committed. None
    when no live member has committed yet."""
    newest = None
    for (wid, rec), raw in zip(records.items(), beats_raw):
        hb = parse_heartbeat(raw)
        if hb is None or hb.since_commit is None or rec.state not in LIVE or wid not in last_seen:
            continue
        at = last_seen[wid] - hb.since_commit * 1000
        newest = at if newest is None else max(newest, at)
    return None if newest is None else max(0.0, (now_ms - newest) / 1000)


def no_commit_threshold(beats: list[Heartbeat], heartbeat_interval: float) -> float:
    """Seconds without a commit after which a running job is shown as not committing."""
    times = sorted(hb.step_time for hb in beats if hb.step_time)
    step = times[len(times) // 2] if times else 0.0
    return max(NO_COMMIT_FLOOR_S, 2 * heartbeat_interval + 1.0, NO_COMMIT_STEPS * step)


def stored_spec(spec_raw: bytes | None) -> JobSpec | None:
    """The stored spec through its model (None when there is none or it does not read)."""
    try:
        return JobSpec.from_stored(spec_raw) if spec_raw else None
    except (ValidationError, ValueError, TypeError):
        return None


def _spec_params(spec_raw: bytes) -> dict:
    """The stored spec's ``params`` ({} when it has none or does not read)."""
    spec = stored_spec(spec_raw)
    return dict(spec.params) if spec is not None else {}


def _heartbeat_interval(spec_raw: bytes) -> float:
    try:
        return float(json.loads(spec_raw).get("heartbeat_interval") or 2.0)
    except (ValueError, TypeError, AttributeError):
        return 2.0


#: Progress entries read per round trip while looking for the start of the window.
RECENT_CHUNK = 128
#: ... and at most this many in all (about 17 minutes of entries at two a second).
RECENT_MAX = 2048


def recent_steps(client: redis.Redis, keys: JobKeys, window_s: float = WINDOW_S
                 ) -> tuple[list[tuple[float, int]], ProgressEntry | None]:
    """The newest committed-step points of the job's ``progress`` stream, oldest first, as
    ``(Redis server time in seconds, step)``: back to the first one ``window_s`` or more
    before the newest (or as far as the stream goes); and the newest step entry that carries
    throughput figures (None: none among those read)."""
    points: list[tuple[float, int]] = []
    figures: ProgressEntry | None = None
    newest: float | None = None
    top, read = "+", 0
    while read < RECENT_MAX:
        chunk = client.xrevrange(keys.progress, max=top, min="-", count=RECENT_CHUNK)
        for sid, fields in chunk:
            entry = ProgressEntry.from_fields(fields)
            if not entry.is_step:
                continue
            t = int(sid.decode().split("-")[0]) / 1000
            points.append((t, entry.step))
            if figures is None and (entry.flops_per_sample or entry.peak_flops or entry.tokens_per_sample):
                figures = entry
            newest = t if newest is None else newest
            if newest - t >= window_s and len(points) >= 2:
                return points[::-1], figures
        read += len(chunk)
        if len(chunk) < RECENT_CHUNK:
            break
        top = "(" + chunk[-1][0].decode()
    return points[::-1], figures


def _figures(beats: list[Heartbeat], entry: ProgressEntry | None, spec_raw: bytes) -> dict:
    """What turns steps/s into samples/s, tokens/s, FLOP/s and MFU: the Active members'
    heartbeats (their FLOPs per sample; their peaks summed, when every member knows its own),
    else rank 0's newest progress entry that has them (its peak times the world size)."""
    def median(values: list) -> float | None:
        values = sorted(v for v in values if v)
        return values[len(values) // 2] if values else None

    flops = median([hb.flops_per_sample for hb in beats])
    tokens = median([hb.tokens_per_sample for hb in beats])
    peaks = [hb.peak_flops for hb in beats]
    peak = sum(peaks) if peaks and all(peaks) else None
    if entry is not None:
        flops = flops or entry.flops_per_sample
        tokens = tokens or entry.tokens_per_sample
        if peak is None and entry.peak_flops and not beats:
            peak = entry.peak_flops * (entry.world_size or 1)
    spec = stored_spec(spec_raw)
    batch = spec.global_batch_size if spec is not None else None
    return {"samples_per_step": batch, "tokens_per_sample": tokens, "flops_per_sample": flops, "peak_flops": peak}


def median_rate(beats: list[Heartbeat]) -> float | None:
    """Steps per second of the median member, from each heartbeat's recent step time: what
    ``status`` shows only while the job has no committed-step history to measure a window
    over (a simulated job, the first seconds of one)."""
    times = sorted(hb.step_time for hb in beats if hb.step_time)
    return 1.0 / times[len(times) // 2] if times else None


def progress(beats: list[Heartbeat], step: int, rate: float | None, *, total: int | None = None) -> dict:
    """Step, total, epoch, percentage, steps/s and ETA of a job at ``step``, going ``rate``
    steps/s: ``total`` when the caller knows it, else what the members' heartbeats say (the
    workers compute it from their dataset); the epoch from the heartbeats too. (A node
    agent's launch unit reports this in its RQ ``meta``.)"""
    totals = [hb.total_steps for hb in beats if hb.total_steps]
    total = total or (max(totals) if totals else None)
    epochs = [hb.epoch for hb in beats if hb.epoch is not None]
    left = max(0, total - step) if total else None
    return {
        "step": step,
        "total_steps": total,
        "epoch": (max(epochs) + 1) if epochs else None,  # 1-based, as people count
        "percent": round(100.0 * min(step, total) / total, 1) if total else None,
        "steps_per_s": round(rate, 3) if rate else None,
        "eta_s": round(left / rate, 1) if rate and left is not None else None,
    }


def _progress(beats: list[Heartbeat], high_step: int, ended: bool, *, completed: bool = False,
              window: Rate | None = None, figures: dict | None = None) -> dict:
    """:func:`progress` from the Active members' heartbeats (the most advanced one's step) at
    the ``window``'s rate (:func:`~shoal.core.throughput.window_rate` of the progress stream;
    without one, the median member's last step time), with samples/s, tokens/s, FLOP/s and MFU
    from ``figures`` (:func:`_figures`) and the seconds the rate spans (``rate_window_s``;
    None: from step times); no rate once the job ended; a completed job's total is the step it
    completed at."""
    step = max([hb.step for hb in beats] + [high_step])
    rate = None if ended else window.steps_per_s if window else median_rate(beats)
    out = progress(beats, step, rate, total=step if completed and step else None)
    f = figures or {}
    t = throughput(rate, f["samples_per_step"], tokens_per_sample=f.get("tokens_per_sample"),
                   flops_per_sample=f.get("flops_per_sample"), peak_flops=f.get("peak_flops")) \
        if rate and f.get("samples_per_step") else None
    out.update({
        "samples_per_s": round(t.samples_per_s, 2) if t else None,
        "tokens_per_s": round(t.tokens_per_s, 1) if t and t.tokens_per_s is not None else None,
        "flops_per_s": float(f"{t.flops_per_s:.4g}") if t and t.flops_per_s is not None else None,
        "mfu": round(t.mfu, 5) if t and t.mfu is not None else None,
        "rate_window_s": round(window.span_s, 1) if rate and window else None,
    })
    return out


#: Heartbeat fields of a streaming dataset's input, shown per worker (text and --json)
STREAM_FIELDS = ("bytes_downloaded", "cache_hit_rate", "shards_owned", "remote_reads", "balance_error")


def si(x: float, unit: str = "") -> str:
    """``x`` with 3 significant digits and an SI prefix: ``950``, ``13.1k``; with a ``unit``
    spaced as people write it: ``2.46 GFLOP``."""
    gap = " " if unit else ""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{gap}{prefix}{unit}"
    return f"{x:.3g}{gap}{unit}" if abs(x) >= 1 or x == 0 else f"{x:.2g}{gap}{unit}"


def _compute_line(s: dict) -> str:
    """The FLOP/s and MFU line of ``format_status`` ("" : no FLOPs per sample known)."""
    f, p = s.get("throughput") or {}, s["progress"]
    if not f.get("flops_per_sample"):
        return ""
    line = f"compute: {si(f['flops_per_sample'], 'FLOP')}/sample"
    if p.get("flops_per_s"):
        line += f"  {si(p['flops_per_s'], 'FLOP')}/s"
    if p.get("mfu") is not None:
        line += f"  MFU {p['mfu'] * 100:.3g} % of {si(f['peak_flops'], 'FLOP')}/s peak"
    elif not f.get("peak_flops"):
        line += "  (MFU: no peak FLOP/s known for these devices; set peak_flops in the job spec)"
    return line


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def _rate(x) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def _num(x) -> str:
    return "-" if x is None else str(x)


def format_status(s: dict) -> str:
    p = s["progress"]
    where = f"step {p['step']}" + (f"/{p['total_steps']} ({p['percent']:g} %)" if p["total_steps"] else "")
    where += f"  epoch {p['epoch']}" if p["epoch"] else ""
    where += f"  {p['steps_per_s']:g} steps/s" if p["steps_per_s"] else ""
    where += f"  {si(p['samples_per_s'])} samples/s" if p.get("samples_per_s") else ""
    where += f"  {si(p['tokens_per_s'])} tokens/s" if p.get("tokens_per_s") else ""
    where += f"  ETA {_duration(p['eta_s'])}" if p["eta_s"] is not None else ""
    where += f"  (over {p['rate_window_s']:g} s)" if p.get("rate_window_s") else ""
    where += f"  no commit for {_duration(s['last_commit_age_s'])}" if s.get("no_commit") else ""
    if s.get("stall"):
        st = s["stall"]
        where += (f" (step {st['step']} failed in {st['generations']} generation(s) of the same members; "
                  f"reported by {', '.join(f'{w} {n}x' for w, n in sorted(st['reporters'].items()))})")
    lines = [
        f"job {s['job_id']}: {s['state']}  generation {s['generation']}  world size {s['world_size']}",
        where,
        f"reason: {s['reason']}",
        f"coordinator: {s['leader'] or 'none (the lease is free)'}  epoch {s['epoch']}",
    ]
    compute = _compute_line(s)
    if compute:
        lines.append(compute)
    if s.get("params"):  # what the entrypoint was called with
        lines.append("params: " + escape_controls(" ".join(f"{k}={json.dumps(v)}" for k, v in s["params"].items())))
    if s["first_failure"]:
        more = f"  ({s['failures']} failures in all: redis-cli XRANGE 'shoal:{{{s['job_id']}}}:failures' - +)" \
            if s["failures"] > 1 else ""
        lines.append(f"first failure: {s['first_failure']}{more}")
        tb = s["first_failure_traceback"].strip().splitlines()
        if len(tb) > 1:
            shown = tb[-TRACEBACK_LINES:]
            lines.append(f"  its output{' (last %d lines)' % len(shown) if len(tb) > len(shown) else ''}:")
            lines += [f"    {escape_controls(line)}" for line in shown]
    if s.get("eval"):
        ev = s["eval"]
        epochs = ev.get("epoch") or 0
        lines.append(f"last evaluation: step {ev.get('step')} ({epochs} epoch{'' if epochs == 1 else 's'} done): "
                     f"{escape_controls(format_metrics(ev['metrics'], limit=2000))}")
    if s.get("steps_redone"):
        lines.append(f"steps redone: {s['steps_redone']} (committed, then lost with every replica that held them; "
                     "the job resumed from a checkpoint or from scratch)")
    if s.get("formation"):
        f = s["formation"]
        retry = f" ; next try in {f['retry_in_ms'] / 1000:.1f} s" if f.get("retry_in_ms") is not None else ""
        strikes = (f"; configuration error {f['configuration_error']} {f['strikes']} time(s) in a row"
                   if f.get("configuration_error") else "")
        lines.append(f"not forming: {f['failures']} generation(s) of the same members failed in a row{strikes}"
                     f"{retry}; last error: {escape_controls(f['last_error'])}")
    if s.get("rejected_joins"):
        lines.append(f"rejected joins: {s['rejected_joins']} (the newest: {s['last_rejection']}); "
                     "those workers did not train")
    if s["dead_letters"]:
        lines.append(f"dead-lettered events: {s['dead_letters']}")
    parts = [w for w in s["workers"] if w.get("compute_time") is not None or w.get("input_wait_time") is not None]
    if parts:  # input wait 0: the pipeline kept ahead; exposed comm 0: backward hid the all-reduce
        ms = lambda t: "-" if t is None else f"{t * 1000:.1f}"  # noqa: E731
        lines.append("last step, ms (compute incl. input wait / input wait / all-reduce not hidden): " + "  ".join(
            f"{w['worker_id']} {ms(w.get('compute_time'))} / {ms(w.get('input_wait_time'))} / "
            f"{ms(w.get('exposed_comm_time'))}" for w in parts))
    streaming = [w for w in s["workers"] if w.get("shards_owned") is not None]
    if streaming:  # a streaming dataset: where each worker's samples came from
        lines.append("streaming input (downloaded / cache hits / shards owned / remote samples / balance error): "
                     + "  ".join(f"{w['worker_id']} {_bytes(w.get('bytes_downloaded'))} / {_rate(w.get('cache_hit_rate'))}"
                                 f" / {w['shards_owned']} / {_num(w.get('remote_reads'))} / {_num(w.get('balance_error'))}"
                                 for w in streaming))
    grouped: dict[str, list[str]] = {}
    for w in s["workers"]:
        if w.get("replica_group") is not None:
            grouped.setdefault(w["replica_group"], []).append(f"{w['worker_id']}:{w['shard']}")
    if grouped:  # elastic HSDP: the replica groups of this generation, members as worker:shard
        lines.append(f"replica groups (shard_size {s.get('shard_size', '?')}): " + "  ".join(
            f"{g} [{' '.join(sorted(m, key=lambda x: int(x.rsplit(':', 1)[1])))}]" for g, m in sorted(grouped.items())))
    mem = [w for w in s["workers"] if w.get("peak_rss_mb") is not None]
    if mem:
        lines.append("peak memory (RSS): " + "  ".join(f"{w['worker_id']} {w['peak_rss_mb']:.0f} MiB" for w in mem))
    placed = [w for w in s["workers"] if w.get("backend")]
    if placed:  # where each worker trains (shoal.worker.placement)
        lines.append("placement (backend / device / GPU): " + "  ".join(
            f"{w['worker_id']} {w['backend']} / {w.get('device') or '-'} / {w.get('gpu') or '-'}" for w in placed))
    lines.append(f"{'worker':<8} {'state':<9} {'rank':>4} {'step':>6} {'loss':>9} {'hb age':>8} {'pid':>8}  "
                 f"{'flags':<9} ranges")
    for w in s["workers"]:
        age = f"{w['heartbeat_age_ms'] / 1000:.1f}s" if w["heartbeat_age_ms"] is not None else "-"
        loss = f"{w['loss']:.4f}" if w["loss"] is not None else "-"
        rank = str(w["rank"]) if w["rank"] is not None else "-"
        step = str(w["step"]) if w["step"] is not None else "-"
        flags = "straggler" if w["straggler"] else ""
        ranges = " ".join(f"[{a},{b})" + (f"/{c}" if c != 1 else "") for a, b, c in w["ranges"])
        pid = str(w["pid"]) if w.get("pid") else "-"
        lines.append(f"{w['worker_id']:<8} {w['state']:<9} {rank:>4} {step:>6} {loss:>9} {age:>8} {pid:>8}  "
                     f"{flags:<9} {ranges}")
    return "\n".join(lines)
