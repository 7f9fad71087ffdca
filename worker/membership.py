"""A worker's side of membership: join, follow shard-table generations, ready, leave.

Everything goes worker -> events stream -> coordinator -> (join reply, shard table) ->
worker; the worker never writes coordinator state.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import redis

from shoal.events import bus, envvars
from shoal.events.exits import WorkerExit
from shoal.events.keys import JobKeys, job_keys
from shoal.events.models import (
    Checkpointed,
    EvalReported,
    EventBase,
    FormationError,
    JobCompleted,
    JoinReply,
    JoinRequest,
    LeaveRequest,
    Left,
    Ready,
    ShardTable,
    StepFailed,
)
from shoal.core.durable import NotReplicated, execute_confirmed
from shoal.core.errors import ShoalError
from shoal.events.records import WorkerRecord
from shoal.worker.placement import Placement

log = logging.getLogger("shoal.worker.membership")

#: How many of the newest published tables :meth:`Membership.table_of` looks through.
TABLE_SCAN = 16


class MembershipError(ShoalError):
    """Base of membership errors."""


class JoinRejected(MembershipError):
    """The coordinator refused the join; the message is its reason."""

    exit_code = WorkerExit.JOIN_REJECTED


class JoinTimeout(MembershipError):
    """No coordinator answered the join in time (none running, or none leading this job)."""

    exit_code = WorkerExit.JOIN_TIMEOUT


class Membership:
    """One worker's membership in one job. Call :meth:`join` first; the other methods need
    the assigned ``worker_id``."""

    def __init__(self, client: redis.Redis, job_id: str, *, node: str = ""):
        self.client = client
        self.keys: JobKeys = job_keys(job_id)
        self.job_id = job_id
        self.node = node
        self.worker_id: str | None = None
        #: shards of the job's streaming dataset, sent with every join (None: not streaming)
        self.num_shards: int | None = None
        #: this worker's placement and its model's device (``cuda:0``), sent with every join
        #: (None: not reported, e.g. a simulated worker)
        self.placement: Placement | None = None
        self.device: str = ""
        self._gen_cursor = "0-0"

    def send(self, event: EventBase) -> str:
        return bus.publish(self.client, self.keys.events, event)

    def join(self, timeout: float, *, last_generation: int = 0) -> str:
        """Ask to join and wait for the coordinator's reply. Raises JoinRejected with the
        coordinator's reason, or JoinTimeout when nobody answered within ``timeout``.
        ``last_generation``: see :class:`shoal.events.models.JoinRequest`."""
        if not self.job_exists():
            raise MembershipError(f"job {self.job_id!r} does not exist (no spec in Redis)")
        where = self.placement
        req = JoinRequest(job_id=self.job_id, host=socket.gethostname(), pid=os.getpid(), node=self.node,
                          last_generation=last_generation, num_shards=self.num_shards,
                          **({} if where is None else {"backend": where.backend, "device": self.device or where.device,
                                                       "gpu": where.gpu, "placement": where.reason[:300]}))
        # read the generation stream from "now": any table published after our join counts
        last = self.client.xrevrange(self.keys.generations, count=1)
        self._gen_cursor = last[0][0].decode() if last else "0-0"
        self.send(req)
        # the reply is awaited in blocks of at most a second and half the client's socket
        # timeout: one BLPOP of the whole timeout outlives the socket timeout whenever no
        # coordinator answers (a partition, a lost request), and each socket timeout then
        # re-sent it through the client's ride-out retries (and, under Sentinel, a discovery
        # of the primary), so the join's own timeout was not kept (seen: over 3 minutes)
        socket_timeout = self.client.connection_pool.connection_kwargs.get("socket_timeout") or 2.0
        block = max(0.1, min(1.0, socket_timeout / 2))
        deadline = time.monotonic() + max(1.0, timeout)
        got = None
        while got is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise JoinTimeout(f"no coordinator answered the join of job {self.job_id!r} within {timeout:.0f} s")
            got = self.client.blpop([self.keys.join_reply(req.event_id)], timeout=round(min(block, max(0.1, left)), 2))
        reply = JoinReply.model_validate_json(got[1])
        if not reply.accepted:
            raise JoinRejected(reply.reason)
        self.worker_id = reply.worker_id
        id_file = envvars.WORKER_ID_FILE.get()
        if id_file:  # lets the node agent name this worker when it reports its exit
            with open(id_file, "w") as fh:
                fh.write(reply.worker_id)
        return reply.worker_id

    def job_exists(self) -> bool:
        return bool(self.client.exists(self.keys.spec))

    def on_record(self) -> bool:
        """True while the job's worker table holds this worker id as this process. False
        once Redis lost it: the job (or its state) vanished, or the id now names another
        process of a job registered again."""
        return self.record() is not None

    def record(self) -> WorkerRecord | None:
        """The coordinator's record of this worker id as this process (None: Redis lost it,
        or the id now names another process)."""
        raw = self.client.hget(self.keys.workers, self.worker_id or "")
        try:
            doc = WorkerRecord.from_json(raw) if raw is not None else None
        except ValueError:  # not a worker record (pydantic's ValidationError is a ValueError)
            return None
        return doc if doc is not None and doc.pid == os.getpid() else None

    def current_table(self) -> ShardTable | None:
        raw = self.client.get(self.keys.shard)
        return ShardTable.model_validate_json(raw) if raw else None

    def next_table(self, after_generation: int, timeout: float) -> ShardTable | None:
        """The newest table with a generation above ``after_generation``, waiting up to
        ``timeout`` s for one to be published; None when none came.

        Under Sentinel a table counts once a replica holds it: one that only a primary cut off
        from its replicas acknowledged may vanish in the fail-over, and a coordinator then
        publishes that generation again with other members; training in it would commit steps
        nobody else knows. So the table returned is the job's current one (the shard key, which
        the coordinator writes with every publish) read in one pipeline with its confirmation
        (:func:`~shoal.core.durable.execute_confirmed`); if no replica confirms it, None, and
        the next call reads it again."""
        cursor = self._gen_cursor
        if self._newer_table(after_generation, timeout) is None:
            return None
        # read again with its confirmation, on one connection: the job's newest table
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.shard)
        try:
            (raw,) = execute_confirmed(self.client, pipe, f"generation table of job {self.job_id}")
        except NotReplicated as exc:
            log.warning("%s; waiting for a replica or a fail-over", exc)
            self._gen_cursor = cursor
            return None
        table = ShardTable.model_validate_json(raw) if raw else None
        return table if table is not None and table.generation > after_generation else None

    def table_of(self, generation: int) -> ShardTable | None:
        """The table of exactly ``generation``, from the newest :data:`TABLE_SCAN` entries of
        the generations stream, read with its confirmation as :meth:`next_table` reads (a
        generation number then names one table: one only a cut-off primary held is never
        returned); None when it is not among them or not confirmed. Every member of a group
        that agreed to switch reads the same one this way (``shoal.worker.decide``: a re-slice
        is adopted in place only by all of them together)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xrevrange(self.keys.generations, count=TABLE_SCAN)
        try:
            (entries,) = execute_confirmed(self.client, pipe, f"generation table of job {self.job_id}")
        except NotReplicated as exc:
            log.warning("%s; switching with a new group", exc)
            return None
        for _sid, fields in entries or []:
            table = ShardTable.model_validate_json(fields[b"data"])
            if table.generation == generation:
                return table
            if table.generation < generation:
                break
        return None

    def _newer_table(self, after_generation: int, timeout: float) -> ShardTable | None:
        cur = self.current_table()
        if cur is not None and cur.generation > after_generation:
            return cur
        resp = self.client.xread({self.keys.generations: self._gen_cursor}, count=100, block=max(1, int(timeout * 1000)))
        newest: ShardTable | None = None
        for _stream, entries in resp or []:
            for sid, fields in entries:
                self._gen_cursor = sid.decode() if isinstance(sid, bytes) else sid
                table = ShardTable.model_validate_json(fields[b"data"])
                if table.generation > after_generation and (newest is None or table.generation > newest.generation):
                    newest = table
        return newest

    def job_state(self) -> str:
        v = self.client.hget(self.keys.state, "state")
        return v.decode() if v else "pending"

    def ready(self, generation: int, step: int | None = None) -> None:
        """This member switched to ``generation`` and starts it from committed ``step`` (None:
        not known to the sender; the coordinator then infers nothing from the step)."""
        self.send(Ready(job_id=self.job_id, worker_id=self.worker_id, generation=generation, step=step))

    def leave(self, reason: str = "SIGTERM") -> None:
        self.send(LeaveRequest(job_id=self.job_id, worker_id=self.worker_id, reason=reason))

    def left(self) -> None:
        self.send(Left(job_id=self.job_id, worker_id=self.worker_id))

    def step_failed(self, generation: int, step: int, error: str, *, rendezvous: bool = False,
                    formation_error: FormationError | None = None, local: bool = False) -> None:
        self.send(StepFailed(job_id=self.job_id, worker_id=self.worker_id, generation=generation, step=step,
                             error=error[:2000], rendezvous=rendezvous, local=local,
                             formation_error=formation_error.value if rendezvous and formation_error else ""))

    def checkpointed(self, step: int, store: str, generation: int) -> None:
        self.send(Checkpointed(job_id=self.job_id, worker_id=self.worker_id, step=step, store=store, generation=generation))

    def evaluated(self, step: int, epoch: int, generation: int, metrics: dict[str, float], *, final: bool = False) -> None:
        """Report an evaluation (rank 0). ``metrics`` must already be what an
        :class:`EvalReported` carries (:func:`~shoal.events.models.finite_metrics`)."""
        self.send(EvalReported(job_id=self.job_id, worker_id=self.worker_id, step=step, epoch=epoch,
                               generation=generation, metrics=metrics, final=final))

    def completed(self, step: int, summary: dict) -> None:
        self.send(JobCompleted(job_id=self.job_id, worker_id=self.worker_id, step=step, summary=summary))
