"""Every Redis key and stream name shoal uses, with the fixed stream caps and key TTLs.
Nothing else in the code base spells a key; TTLs that are settings (lease, heartbeat,
relaunch cooldown) come from those settings, every other cap or TTL is a constant here.

All keys of one job share the hash tag ``{JOB}`` so that multi-key Lua scripts (the fenced
coordinator write, the heartbeat) stay legal on Redis Cluster. The few global keys (the job
registry) are read with single-key commands only.

``docs/keys.md`` is the human-facing table of this module (type, writer, reader, TTL);
keep them in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "shoal"

#: Set of every registered job id. Writer: ``shoal submit``/``create_job``. Reader: coordinators.
JOBS = f"{PREFIX}:jobs"

#: HASH lease token -> ``"<Redis ms last seen>:<jobs led>"``, one entry per coordinator
#: replica. Writer: each replica, every lease refresh (and HDEL on shutdown; any replica
#: deletes entries left stale). Reader: replicas, to spread leases (``coordinator/balance.py``).
COORDINATORS = f"{PREFIX}:coordinators"

#: STRING (the writer's unix time): the marker a durable write or read under Sentinel writes
#: in its pipeline before ``WAIT`` (``core/durable.py``), so that a replica's acknowledgement
#: covers everything the pipeline did. Writer: any client confirming one. Reader: nobody.
#: Expires after :data:`DURABLE_MARKER_TTL_MS`.
DURABLE_MARKER = f"{PREFIX}:durable"
DURABLE_MARKER_TTL_MS = 60_000

#: RQ queue on which launch work for node agents is enqueued.
LAUNCH_QUEUE = "shoal-launch"

#: Seconds between the registration heartbeats of a queue node agent (``shoal agent --queue``,
#: an RQ worker): it refreshes ``last_heartbeat`` of its RQ worker hash at least this often,
#: idle or running a unit. ``shoal health agent`` judges an agent stale after
#: ``AGENT_STALE_HEARTBEATS`` of these (the agent's ``--heartbeat`` changes it for that agent).
AGENT_HEARTBEAT_S = 30
AGENT_STALE_HEARTBEATS = 3

#: Prefix of the RQ job id of every launch unit (RQ stores the unit at ``rq:job:<id>``).
#: Writer: ``shoal submit`` and the coordinator's launcher. Reader: ``shoal agent --queue``.
LAUNCH_UNIT_PREFIX = "shoal-launch-"
_UNIT_SUFFIX = re.compile(r"^[0-9a-f]{12}$")

#: How long RQ keeps a finished or failed launch unit (its result / traceback), seconds.
LAUNCH_UNIT_RESULT_TTL_S = 7 * 24 * 3600

# ---- caps (XADD MAXLEN ~) of the informational streams and TTLs of the job keys below ----
#: Cap of ``generations``: workers only ever need the newest shard tables.
GENERATIONS_MAXLEN = 1_000
#: Cap of ``control``, the coordinator's decision log (``shoal events``).
CONTROL_MAXLEN = 10_000
#: Cap of ``dead``, the dead-lettered events.
DEAD_MAXLEN = 10_000
#: Cap of ``failures``, the history of worker failures.
FAILURES_MAXLEN = 1_000
#: Cap of ``logs``, the workers' log lines (``shoal logs``).
LOGS_MAXLEN = 10_000
#: Cap of ``progress``, the committed steps ``shoal report`` plots.
PROGRESS_MAXLEN = 100_000
#: TTL of a ``join_reply`` list, seconds: a reply nobody popped (the joiner gave up) expires.
JOIN_REPLY_TTL_S = 60
#: TTL of the keys under a generation's ``rendezvous`` prefix, seconds (each generation has its own).
RENDEZVOUS_TTL_S = 3600

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def valid_job_id(job_id: str) -> bool:
    """True when ``job_id`` is safe inside a key (no braces, colons or spaces; 1-64 chars)."""
    return bool(_JOB_ID.match(job_id))


@dataclass(frozen=True)
class JobKeys:
    """Key names of one job. Construct with :func:`job_keys`; invalid ids raise ``ValueError``."""

    job_id: str

    @property
    def base(self) -> str:
        return f"{PREFIX}:{{{self.job_id}}}"

    # --- written at submit time -------------------------------------------------------------
    @property
    def spec(self) -> str:
        """STRING, JSON job spec. Writer: submit. Readers: coordinator, workers, agents."""
        return f"{self.base}:spec"

    # --- coordinator-owned (every write fenced by the lease epoch) -------------------------
    @property
    def code(self) -> str:
        """HASH ``sha256``, ``size``, ``files``, ``tar`` (gzip'd tar of the spec's
        ``working_dir``). Writer: submit/create (same MULTI/EXEC as the spec); an agent that
        registers a lost job again. Reader: node agents, which verify the checksum and unpack it."""
        return f"{self.base}:code"

    @property
    def lease(self) -> str:
        """STRING ``token``, PX = lease TTL. The coordinator replica holding it leads this job."""
        return f"{self.base}:lease"

    @property
    def handoff(self) -> str:
        """STRING token of the replica a job's leader is handing it to, PX = a few lease TTLs.
        While it exists, only that replica may take the free lease (``coordinator/lease.py``)."""
        return f"{self.base}:handoff"

    @property
    def epoch(self) -> str:
        """STRING integer fencing epoch, incremented on every lease takeover."""
        return f"{self.base}:epoch"

    @property
    def state(self) -> str:
        """HASH job-level state (state, generation, reason, applied, ...). Writer: coordinator."""
        return f"{self.base}:state"

    @property
    def workers(self) -> str:
        """HASH worker_id -> JSON worker record (:class:`shoal.events.records.WorkerRecord`).
        Writer: coordinator."""
        return f"{self.base}:workers"

    @property
    def shard(self) -> str:
        """STRING JSON of the current shard table. Writer: coordinator. Readers: workers, status."""
        return f"{self.base}:shard"

    @property
    def generations(self) -> str:
        """STREAM of published shard tables (field ``data``); workers block on it, and read one
        generation's table from its newest entries at a switch with slices by speed. Capped
        at ~:data:`GENERATIONS_MAXLEN`."""
        return f"{self.base}:generations"

    @property
    def control(self) -> str:
        """STREAM of coordinator decisions with their reasons (``shoal events``). Capped at
        ~:data:`CONTROL_MAXLEN`."""
        return f"{self.base}:control"

    def join_reply(self, event_id: str) -> str:
        """LIST holding the single reply to a join request (accepted + worker id, or the reason).
        Writer: coordinator. Reader: the joining worker (BLPOP). TTL :data:`JOIN_REPLY_TTL_S`."""
        return f"{self.base}:join:{event_id}"

    @property
    def latest(self) -> str:
        """STRING JSON pointer to the newest complete checkpoint; never moves backwards."""
        return f"{self.base}:latest"

    # --- written by workers -----------------------------------------------------------------
    @property
    def events(self) -> str:
        """STREAM of worker -> coordinator events (field ``data``: JSON). Consumer group ``coordinators``."""
        return f"{self.base}:events"

    @property
    def dead(self) -> str:
        """STREAM of dead-lettered events: original fields + ``reason`` + ``source_id``. Capped at
        ~:data:`DEAD_MAXLEN`."""
        return f"{self.base}:dead"

    def heartbeat(self, worker_id: str) -> str:
        """STRING JSON progress (step, step time, digest), PX = heartbeat TTL. Writer: the worker."""
        return f"{self.base}:hb:{worker_id}"

    @property
    def last_seen(self) -> str:
        """ZSET worker_id -> Redis server time (ms) of its last heartbeat. Scanned for staleness."""
        return f"{self.base}:last_seen"

    @property
    def busy(self) -> str:
        """ZSET worker_id -> Redis server time (ms) at which the worker's current step began its
        own work (data, forward, backward, update - not waiting on peers), as of its last
        heartbeat; absent while it is not inside a step or waits on a collective. Writer: the
        worker's heartbeat; the coordinator scans it for members past the step timeout."""
        return f"{self.base}:busy"

    @property
    def logs(self) -> str:
        """STREAM of worker log lines (``shoal logs``). Capped at ~:data:`LOGS_MAXLEN`."""
        return f"{self.base}:logs"

    @property
    def progress(self) -> str:
        """STREAM of committed progress: ``step``, ``loss``, ``generation``, ``world_size``, ``t``
        (the worker's unix time); the entry id is Redis server time, the clock of ``control``.
        Writer: rank 0 of the training worker (``worker/progress.py``: at most one entry per
        0.5 s, plus the first step of each generation; dropped when Redis is down). Rank 0 also
        appends every evaluation: ``kind`` = ``eval``, ``step``, ``epoch``, ``generation``,
        ``metrics`` (JSON), ``t``; entries without ``kind`` are committed steps. Readers:
        ``shoal report``, the HTTP API's chart data (``GET /jobs/{id}/progress``). Capped at ~:data:`PROGRESS_MAXLEN` entries. The coordinator never reads it."""
        return f"{self.base}:progress"

    @property
    def failures(self) -> str:
        """STREAM of worker failures as the coordinator decided them (fenced): ``ts_ms``,
        ``worker``, ``rank`` (-1: none), ``reason``, ``exit_code`` or ``signal`` and the
        ``traceback`` a node agent reported (empty for a heartbeat timeout). Capped at
        ~:data:`FAILURES_MAXLEN`."""
        return f"{self.base}:failures"

    @property
    def launch(self) -> str:
        """HASH launch settings of a queue-launched job (``workers`` per launch unit, ``units``;
        :class:`shoal.events.models.LaunchSettings`).
        Writer: ``shoal submit`` (in the transaction that registers the job). Reader: the
        coordinator's launcher, which re-enqueues launch units only for jobs that have it."""
        return f"{self.base}:launch"

    @property
    def relaunch(self) -> str:
        """STRING launcher replica id, PX = the re-enqueue cooldown. Writer: the launcher
        (SET NX): at most one re-enqueue of a job's launch units per cooldown, across replicas."""
        return f"{self.base}:relaunch"

    def rendezvous(self, generation: int) -> str:
        """Prefix of the torch.distributed store keys of one generation (fresh per generation);
        its keys expire after :data:`RENDEZVOUS_TTL_S`."""
        return f"{self.base}:rdzv:{generation}:"

    def replica_rendezvous(self, group: str, generation: int) -> str:
        """Prefix of the store keys that form elastic HSDP replica group ``group``'s shard group,
        in the generation it first trained in (a fresh prefix per try; same TTL)."""
        return f"{self.base}:rdzv:rg:{group}:{generation}:"

    def cross_rendezvous(self, generation: int, shard: int) -> str:
        """Prefix of the store keys of generation ``generation``'s cross-replica group of shard
        index ``shard`` (elastic HSDP; same TTL)."""
        return self.rendezvous(generation) + f"x{shard}:"

    def barrier(self, generation: int) -> str:
        """SET of the worker ids that arrived at generation ``generation``'s barrier before
        forming its group (under the generation's rendezvous prefix, same TTL)."""
        return self.rendezvous(generation) + "arrived"

    def barrier_done(self, generation: int) -> str:
        """LIST of tokens, one per member, pushed by the member whose arrival completed
        :meth:`barrier`; each member blocks on it (BLPOP) and takes one. Same prefix and TTL."""
        return self.rendezvous(generation) + "done"

    def barrier_wake(self, generation: int, worker_id: str) -> str:
        """LIST a worker's own thread pushes to, to end that worker's wait at generation
        ``generation``'s barrier early (a newer table, the job's end). Same prefix and TTL."""
        return self.rendezvous(generation) + f"wake:{worker_id}"

    def all_patterns(self) -> list[str]:
        """SCAN patterns that together match every key of this job (used by delete/purge)."""
        return [f"{self.base}:*"]


COORDINATOR_GROUP = "coordinators"


def job_keys(job_id: str) -> JobKeys:
    if not valid_job_id(job_id):
        raise ValueError(
            f"invalid job id {job_id!r}: use 1-64 letters, digits, '_', '.', '-' (no braces or colons)"
        )
    return JobKeys(job_id)


_JOB_FROM_KEY = re.compile(rf"^{PREFIX}:\{{([^}}]+)\}}:")


def job_of_key(key: str) -> str | None:
    """The job id embedded in a shoal key, or None for a global/foreign key."""
    m = _JOB_FROM_KEY.match(key)
    return m.group(1) if m else None


def launch_unit_id(job_id: str, unique: str) -> str:
    """RQ job id of one launch unit of ``job_id``: ``shoal-launch-<job>-<unique>``.

    RQ ids allow only letters, digits, ``_`` and ``-``, so the job id is escaped reversibly
    (``_`` -> ``__``, ``.`` -> ``_d``); ``unique`` is 12 lowercase hex digits."""
    if not valid_job_id(job_id):
        raise ValueError(f"invalid job id {job_id!r}")
    if not _UNIT_SUFFIX.match(unique):
        raise ValueError(f"launch unit suffix must be 12 hex digits, got {unique!r}")
    return f"{LAUNCH_UNIT_PREFIX}{job_id.replace('_', '__').replace('.', '_d')}-{unique}"


def job_of_launch_unit(rq_id: str) -> str | None:
    """The job id a launch unit's RQ id belongs to, or None for any other RQ job id."""
    if not rq_id.startswith(LAUNCH_UNIT_PREFIX) or len(rq_id) < len(LAUNCH_UNIT_PREFIX) + 14:
        return None
    body, sep, unique = rq_id[len(LAUNCH_UNIT_PREFIX):-13], rq_id[-13], rq_id[-12:]
    if sep != "-" or not _UNIT_SUFFIX.match(unique):
        return None
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "_":
            nxt = body[i + 1:i + 2]
            if nxt == "_":
                out.append("_")
            elif nxt == "d":
                out.append(".")
            else:
                return None
            i += 2
        else:
            out.append(c)
            i += 1
    job_id = "".join(out)
    return job_id if valid_job_id(job_id) else None
