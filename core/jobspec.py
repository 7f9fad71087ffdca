"""The job spec: what a user submits (YAML), validated by pydantic before anything is queued.

The spec is stored as JSON at ``keys.spec``; readers tolerate fields they do not know
(``extra="ignore"`` on read) so older readers survive newer specs. Connection settings
(``REDIS_URL``, ``S3_ENDPOINT``, credentials) never live in the spec: they come from the
environment, so no secret is ever written to Redis.
"""

from __future__ import annotations

import keyword
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator, model_validator

from shoal.events.keys import valid_job_id
from shoal.events.validation import every_error
from shoal.core.errors import ConfigError
from shoal.core.yamlfile import printable, read_yaml


class ShardStrategy(str, Enum):
    contiguous = "contiguous"
    round_robin = "round_robin"
    hash = "hash"


#: Upper bound of ``max_workers``: ``shoal submit`` queues up to that many launch units and
#: the coordinator's launcher sizes re-enqueues from it, so it must stay a sane number.
MAX_WORKERS = 4096


class CompileOptions(BaseModel):
    """``torch.compile``'s options for a job's model (``compile:`` in the spec; ``true`` is
    all defaults). ``mode``: inductor's mode; ``fullgraph``: refuse graph breaks;
    ``dynamic``: dynamic shapes (None: torch's automatic choice)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    fullgraph: bool = False
    dynamic: bool | None = None


class KeepBest(BaseModel):
    """``checkpoint_keep_best``: besides the newest ``checkpoint_keep``, retention keeps the
    checkpoint whose evaluation had the best ``metric`` (``mode`` min or max), e.g.
    ``{metric: val_loss, mode: min}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: Annotated[str, Field(min_length=1, max_length=64)]
    mode: Literal["min", "max"] = "min"


class DilocoOptions(BaseModel):
    """``diloco:`` in the spec (with ``sync: diloco``): semi-synchronous training (DiLoCo,
    Douillard et al. 2023). Each member runs ``inner_steps`` (H) steps of the user's own
    optimizer from the global weights on its own samples, then the outer gradient (the global
    weights minus the members' weights, averaged weighted by their samples) is all-reduced once
    and an outer Nesterov SGD (``outer_lr``, ``outer_momentum``) steps the global weights.
    ``outer_dtype``: the outer gradient's wire format - fp32, bf16, or int8 with one fp32 scale
    per ``outer_block`` values (both accumulated in fp32)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    inner_steps: Annotated[int, Field(ge=1, le=100_000)] = 50
    outer_lr: Annotated[float, Field(gt=0, le=10)] = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    outer_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    outer_block: Annotated[int, Field(ge=16, le=1 << 20)] = 256


class JobSpec(BaseModel):
    """A training job. Times are seconds. ``entrypoint`` is ``module:function``."""

    # no inf/nan: JSON cannot hold them, so the stored spec would not read back
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    entrypoint: str = "shoal.examples.digits:build"
    #: Keyword arguments of the entrypoint: ``params: {lr: 3e-4, n_layer: 6}`` calls
    #: ``build(lr=3e-4, n_layer=6)`` on every worker (the same call everywhere). JSON values
    #: (numbers, strings, booleans, null, lists, mappings); names must be Python identifiers.
    #: ``shoal create``/``submit`` check them against the function's signature (a missing or
    #: unexpected argument is refused, naming it); ``--set params.lr=1e-3`` sets one.
    params: dict[str, JsonValue] = Field(default_factory=dict)
    global_batch_size: Annotated[int, Field(gt=0)] = 64
    epochs: Annotated[int, Field(gt=0)] = 1
    max_steps: Annotated[int | None, Field(gt=0)] = None
    #: Seeds python, numpy and torch in every worker and the data order; torch takes no more
    #: than 64 bits, so a larger seed would crash every worker at start (a crash loop).
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    min_workers: Annotated[int, Field(ge=1)] = 1
    max_workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] = 8
    heartbeat_interval: Annotated[float, Field(gt=0, le=60)] = 0.5
    heartbeat_ttl: Annotated[float, Field(gt=0, le=600)] = 2.0
    max_restarts: Annotated[int, Field(ge=0)] = 3
    checkpoint_uri: str | None = None
    checkpoint_interval: Annotated[int, Field(ge=0)] = 0
    checkpoint_keep: Annotated[int, Field(ge=1)] = 3
    #: Also keep the checkpoint whose evaluation was the best by a metric (an evaluation of the
    #: step a checkpoint was saved at): ``{metric: val_loss, mode: min}``. None: the newest only.
    checkpoint_keep_best: KeepBest | None = None
    #: Warm start (fine-tuning): a job with no checkpoint of its own yet loads the newest
    #: checkpoint in this store (``file://`` or ``s3://``, another job's ``checkpoint_uri``):
    #: its weights, and with ``init_from_optimizer`` its optimizer's per-parameter state (the
    #: job keeps its own hyperparameters); never its LR scheduler, RNG or data position: the
    #: job starts at step 0 of epoch 0. Once the job has a checkpoint of its own, a restart
    #: resumes from that. Checked at submit: a store without a readable checkpoint is refused.
    init_from: str | None = None
    init_from_optimizer: bool = False
    data_uri: str | None = None
    shard_strategy: ShardStrategy = ShardStrategy.contiguous
    #: Size of the index space the shard table splits. Defaults to the global batch size:
    #: each rank takes its ranges of every global batch.
    num_samples: Annotated[int | None, Field(gt=0)] = None
    #: A worker whose recent step time exceeds ``straggler_factor`` x the job median is flagged.
    straggler_factor: Annotated[float, Field(gt=1)] = 2.0
    #: A running job whose planned generations have all failed to form (no member reported
    #: ready) for this long fails, with the last rendezvous error as its reason, instead of
    #: planning new generations forever (a wrong interface, a firewall between nodes).
    formation_timeout: Annotated[float, Field(gt=0, le=86400)] = 300.0
    #: Progress: a member whose step has been busy (its own data, forward, backward - not
    #: waiting on peers) this long while its heartbeat is alive is evicted with a reason
    #: naming the step timeout, and its peers go on without it. Until then a slow peer is
    #: waited for, like DDP does. Raise it for steps that can legitimately take longer. The
    #: workers' collective timeout is derived from it (plus a margin over the heartbeat TTL):
    #: a collective is never the failure detector. With ``sync: diloco`` it bounds a round's
    #: inner steps; the outer exchange is waiting on peers, however long a slow link makes it
    #: (its collective timeout bounds each piece of it: ``shoal.worker.outer``).
    step_timeout: Annotated[float, Field(gt=0, le=86400)] = 60.0
    #: Elastic HSDP: workers form replica groups of ``shard_size``; each replica group shards
    #: the model, its gradients and its optimizer state over its members (FSDP2), and the
    #: gradients are all-reduced across replica groups. Replica groups are the unit of
    #: elasticity: a member that fails, hangs or leaves takes its whole group out (its agent
    #: restarts the members, which rejoin as a new group); the other groups keep their
    #: processes. 1: data parallelism (every worker holds the whole model). ``min_workers`` and
    #: ``max_workers`` count workers: multiples of ``shard_size``; the global batch must divide
    #: by ``shard_size`` x every replica count between them (every rank takes as many samples).
    shard_size: Annotated[int, Field(ge=1, le=1024)] = 1
    #: How the members' work is combined: ``step`` (every step all-reduces the gradient:
    #: data parallelism, or HSDP with ``shard_size`` > 1) or ``diloco`` (semi-synchronous:
    #: every member runs ``diloco.inner_steps`` local steps, then one outer step; see
    #: :class:`DilocoOptions`). With ``diloco`` a *step* of the job - ``max_steps``, the
    #: checkpoint interval, the ledger, ``eval_every_steps`` - is a round (one outer step) of
    #: ``inner_steps x global_batch_size`` samples; ``global_batch_size`` is the samples of one
    #: inner step over all members. One worker per replica (``shard_size`` 1).
    sync: Literal["step", "diloco"] = "step"
    #: DiLoCo's options (``sync: diloco``; defaults when omitted).
    diloco: DilocoOptions | None = None
    #: Numeric precision of forward and backward: fp32, or autocast to bf16 / fp16 (fp16 with
    #: a gradient scaler whose state is checkpointed and sent to joiners).
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: The process group backend between the workers: ``auto`` picks NCCL when every worker
    #: of a node has a GPU of its own, else gloo (with the model on the GPU when one is
    #: visible); ``nccl`` refuses a node with more workers than GPUs; ``gloo`` always. The
    #: members of a generation must agree. Chosen per node by its agent
    #: (:mod:`shoal.worker.placement`), shown per worker by ``shoal status``.
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    #: Where each worker's model lives: ``auto`` (its GPU when one is visible, else the CPU),
    #: ``cuda`` (refused on a node without a GPU) or ``cpu``.
    device: Literal["auto", "cuda", "cpu"] = "auto"
    #: Clip the reduced global gradient to this L2 norm (world-size invariant); None: no clipping.
    max_grad_norm: Annotated[float | None, Field(gt=0)] = None
    #: Gradients are all-reduced in buckets of about this many MiB while backward still runs.
    bucket_cap_mb: Annotated[float, Field(gt=0, le=4096)] = 25.0
    #: ``torch.compile`` the model, applied by shoal where the layout needs it (data
    #: parallelism: the model's forward; elastic HSDP: each shard unit before it is sharded):
    #: ``false`` (default), ``true``, or ``{mode, fullgraph, dynamic}``. Checkpoints, digests and
    #: state transfers keep the model's own names, so a compiled job's checkpoint resumes
    #: uncompiled and the other way round. A compiled rank's work goes in micro-batches of one
    #: fixed shape for the whole job (``TrainingSetup.micro_batch``, else the slice of the
    #: largest world size: ``ceil(global_batch_size / max_workers)``), so a membership change
    #: never recompiles; a data-parallel worker compiles on that shape before it joins.
    compile: bool | CompileOptions = False
    #: Elastic HSDP: recompute each shard unit's activations in backward instead of keeping
    #: them (``torch.utils.checkpoint``, non-reentrant): less memory, one more forward per unit.
    activation_checkpointing: bool = False
    #: The input pipeline (shoal.worker.prefetch): ``loader_workers`` background loaders
    #: fetch and collate the batches of the next ``prefetch_steps`` steps of each worker.
    #: Loaders are processes (forked on Linux, like DataLoader's workers; they die with their
    #: worker); ``loader_workers: 0`` is one loader thread in the worker (a dataset that cannot
    #: be forked); ``prefetch_steps: 0`` fetches every batch inline in the training thread.
    #: A ``TrainingSetup`` may override both for its dataset.
    loader_workers: Annotated[int, Field(ge=0, le=64)] = 1
    prefetch_steps: Annotated[int, Field(ge=0, le=64)] = 2
    #: Evaluation during training: ``eval_fn`` runs every this many committed steps, or at the
    #: end of every this many epochs (at most one of the two); it always runs at the end.
    #: Every member evaluates the same committed step (identical replicas: nobody waits for
    #: rank 0), rank 0 reports the metrics (``shoal status``, ``shoal events``, the report).
    #: The evaluation counts toward ``step_timeout`` together with the next step's own work:
    #: raise it when an evaluation plus a step can take longer. Ignored without an ``eval_fn``.
    eval_every_steps: Annotated[int | None, Field(gt=0)] = None
    eval_every_epochs: Annotated[int | None, Field(gt=0)] = None
    #: Python's cyclic garbage collector in the workers: off during training and run every this
    #: many committed steps, at the same steps on every member, with what exists when training
    #: starts frozen (``gc.freeze``: modules, model, dataset), as torchtitan's ``gc_freq`` and
    #: Megatron's ``manual_gc`` do: left automatic, a full collection walks the whole heap
    #: (0.14 s after ``import torch`` on a CPU) on each rank at its own step, and the group
    #: waits for it (:mod:`shoal.worker.collector`). 0: Python's automatic collection. Code
    #: whose steps leave reference cycles holding tensors keeps them up to this many steps.
    gc_every_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 50
    #: A local directory shipped with the job (like Ray's ``runtime_env.working_dir``): packed
    #: at submit (bounded, checksummed), unpacked by each node agent into a per-job directory
    #: that is its workers' working directory and first on their ``sys.path``. Relative to the
    #: spec file's directory (to the current directory for ``--set``). The stored spec holds
    #: the absolute path, for display; agents never read it.
    working_dir: str | None = None
    #: Glob patterns (matched against each path relative to ``working_dir`` and against each
    #: name) left out of the package, besides the defaults (``.git``, ``__pycache__``, ...).
    working_dir_excludes: tuple[str, ...] = ()
    #: TensorBoard event files of the job: rank 0 of the current generation writes its
    #: scalars (loss, steps/s, world size, generation, learning rate, evaluation metrics) and
    #: each membership change as text here. An absolute local path (or ``file:///path``), or
    #: ``s3://bucket/prefix`` (written locally, uploaded periodically and at the end; S3
    #: settings from the environment, as for checkpoints). Needs the ``tensorboard`` package
    #: (``pip install 'shoal[tensorboard]'``) on the submitting machine and the workers.
    tensorboard_dir: str | None = None
    #: Peak FLOP/s of one worker's device at the job's precision (dense), for the MFU that
    #: ``shoal status``, the report and TensorBoard show: needed on a CPU or a GPU not in
    #: ``shoal.worker.flops.PEAKS`` (H100/H200/A100/L40S/L4/... are known by name). None:
    #: the table's figure, else no MFU.
    peak_flops: Annotated[float | None, Field(gt=0)] = None
    #: FLOPs of one sample's forward and backward, declared (e.g. 6 x parameters x tokens per
    #: sample for a transformer). None: measured with torch's FLOP counter on each worker's
    #: first committed step (``shoal.worker.flops``).
    flops_per_sample: Annotated[float | None, Field(gt=0)] = None
    #: How the global batch is split among a data-parallel generation's members: ``equal``
    #: (default: near-equal contiguous slices, a function of the membership alone) or
    #: ``by_speed``: each member's slice follows its measured rate of its own work (samples per
    #: second of data, forward and backward, from the counters its heartbeat reports), so a slow
    #: member no longer sets the pace. Re-planned at every generation switch and, when the
    #: measured rates would shorten the step by more than 5 %, at most every
    #: ``batch_split_every`` committed steps (a re-plan is a generation switch of the same
    #: members). The global batch never changes, so the update is the same as with equal slices
    #: (losses are summed and divided by the global count; models without BatchNorm or dropout).
    #: Data parallelism with contiguous slices only (``shard_size`` 1, ``shard_strategy``
    #: contiguous); a streaming dataset keeps its split by shard owner.
    batch_split: Literal["equal", "by_speed"] = "equal"
    #: ``batch_split: by_speed``: committed steps between two looks at whether the slices
    #: should be re-planned (besides membership changes, which always re-plan).
    batch_split_every: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    #: ``batch_split: by_speed``: within each step, a member done with its slice takes chunks
    #: of the slices still being worked on (each slice is cut in chunks - the setup's
    #: ``micro_batch``, else about 1/16 of a slice at ``max_workers`` - claimed one by one in the
    #: generation's rendezvous store), so a member slowed for a moment does not hold up the
    #: step; every sample is still trained once, and the update is the same. Off by default:
    #: measured +3-7 % samples/s where members' CPUs are their own, nil on an oversubscribed
    #: box, and ~16 Redis calls per member per step (docs/training.md).
    batch_split_steal: bool = False
    #: Simulated step time for workers with ``entrypoint: simulate`` (control-plane tests).
    simulate_step_time: Annotated[float, Field(ge=0)] = 0.05

    @field_validator("name")
    @classmethod
    def _name_is_key_safe(cls, v: str) -> str:
        if not valid_job_id(v):
            raise ValueError("use letters, digits, '_', '.', '-' only (it becomes part of Redis keys)")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, v: str) -> str:
        if v != "simulate" and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError("must be 'module:function' (or 'simulate')")
        return v

    @field_validator("params")
    @classmethod
    def _params_are_keywords(cls, v: dict) -> dict:
        bad = [name for name in v if not name.isidentifier() or keyword.iskeyword(name)]
        if bad:
            raise ValueError(f"{printable(bad[0])!r} is not a keyword argument name (a Python identifier)")
        return v

    @field_validator("checkpoint_uri", "data_uri", "init_from")
    @classmethod
    def _uri_scheme(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError("must start with file:// or s3://")
        if v is not None and "@" in v.split("://", 1)[1].split("/", 1)[0]:
            # the spec is stored in Redis and shown by status and the HTTP API: no secrets in it
            raise ValueError("must not carry credentials (user:password@); S3 settings come from the environment")
        return v

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_dir(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("s3://"):
            if not v[len("s3://"):].split("/")[0]:
                raise ValueError("s3:// needs a bucket: s3://bucket/prefix")
            return v
        path = v[len("file://"):] if v.startswith("file://") else v
        if not path.startswith("/"):
            raise ValueError("must be an absolute path, file:///absolute/path or s3://bucket/prefix")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> "JobSpec":
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) exceeds max_workers ({self.max_workers})")
        if self.heartbeat_ttl <= self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_ttl ({self.heartbeat_ttl}) must exceed heartbeat_interval ({self.heartbeat_interval})"
            )
        if self.eval_every_steps is not None and self.eval_every_epochs is not None:
            raise ValueError("set eval_every_steps or eval_every_epochs, not both")
        if self.shard_size > 1:
            self._check_replica_groups()
        if self.activation_checkpointing and self.shard_size == 1:
            raise ValueError("activation_checkpointing applies to elastic HSDP's shard units (shard_size > 1)")
        if self.init_from_optimizer and not self.init_from:
            raise ValueError("init_from_optimizer applies to a warm start: set init_from too")
        if self.init_from and self.checkpoint_uri and _same_store(self.init_from, self.checkpoint_uri):
            raise ValueError(f"init_from is the job's own checkpoint_uri ({self.checkpoint_uri}): a job resumes its "
                             "own checkpoints by itself; init_from names another job's store")
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend nccl needs the model on a GPU: use device cuda (or auto), or backend gloo")
        if self.diloco is not None and self.sync != "diloco":
            raise ValueError("diloco options apply to sync: diloco (this job has sync: step)")
        if self.sync == "diloco":
            self._check_diloco()
        if self.batch_split == "by_speed" and self.shard_size > 1:
            raise ValueError("batch_split by_speed applies to data parallelism (shard_size 1): every rank of an HSDP "
                             "replica group takes as many samples")
        if self.batch_split == "by_speed" and self.sync == "diloco":
            raise ValueError("batch_split by_speed applies to sync: step (a DiLoCo round splits its samples equally)")
        if self.batch_split == "by_speed" and self.shard_strategy != ShardStrategy.contiguous:
            raise ValueError(f"batch_split by_speed sizes contiguous slices: use shard_strategy contiguous, not "
                             f"{self.shard_strategy.value}")
        if self.entrypoint != "simulate" and self.num_samples not in (None, self.step_samples):
            raise ValueError("num_samples applies to simulated jobs only: training shards each global batch")
        return self

    @property
    def compile_options(self) -> CompileOptions | None:
        """``compile`` as options (None: not compiled)."""
        if self.compile is True:
            return CompileOptions()
        return self.compile or None

    def _check_replica_groups(self) -> None:
        s = self.shard_size
        for name in ("min_workers", "max_workers"):
            if getattr(self, name) % s:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of shard_size ({s}): workers "
                                 "come and go as whole replica groups")
        for replicas in range(self.min_workers // s, self.max_workers // s + 1):
            if self.global_batch_size % (s * replicas):
                raise ValueError(f"global_batch_size ({self.global_batch_size}) must divide by shard_size x replicas "
                                 f"= {s} x {replicas} for every replica count the job allows (min_workers to "
                                 "max_workers): every rank of a replica group takes as many samples")
        if self.precision == "fp16":
            raise ValueError("precision fp16 (a loss scale) is not supported with shard_size > 1: use bf16 or fp32")

    def _check_diloco(self) -> None:
        if self.shard_size != 1:
            raise ValueError(f"sync: diloco needs shard_size 1 (a DiLoCo replica is one worker); shard_size is "
                             f"{self.shard_size}")
        if self.precision == "fp16":
            raise ValueError("precision fp16 (a loss scale) is not supported with sync: diloco: use bf16 or fp32")
        if self.entrypoint == "simulate":
            raise ValueError("sync: diloco trains a model: not with entrypoint simulate")
        if self.compile:
            raise ValueError("compile is not supported with sync: diloco yet: set compile: false")

    @property
    def diloco_options(self) -> DilocoOptions | None:
        """DiLoCo's options (the defaults when ``diloco`` is omitted); None unless ``sync: diloco``."""
        if self.sync != "diloco":
            return None
        return self.diloco or DilocoOptions()

    @property
    def step_samples(self) -> int:
        """The samples one step of the job takes from the data order: the global batch, or in
        DiLoCo a round's (``inner_steps`` x the global batch). The data order, the shard table
        and the prefetcher cut steps of this size."""
        options = self.diloco_options
        return self.global_batch_size * (options.inner_steps if options is not None else 1)

    @property
    def replicas(self) -> tuple[int, int]:
        """The fewest and most replica groups the job allows."""
        return self.min_workers // self.shard_size, self.max_workers // self.shard_size

    @property
    def shard_space(self) -> int:
        return self.num_samples or self.step_samples

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_stored(cls, raw: str | bytes) -> "JobSpec":
        """Parse a spec read back from Redis, ignoring fields added by newer writers."""
        import json

        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.model_fields}
        return cls.model_validate(known)


def _same_store(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def _format_errors(exc: ValidationError) -> str:
    return every_error(exc, root="(spec)", name=printable)


def parse_spec(data: object, source: str = "job spec") -> JobSpec:
    """Validate a mapping as a JobSpec; raises ConfigError naming each bad field path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid: {_format_errors(exc)}") from exc


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a YAML job spec file; every failure is a one-line ConfigError."""
    return parse_spec(read_yaml(path, "job spec"), str(path))
