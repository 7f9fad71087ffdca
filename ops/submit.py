"""``shoal submit``: validate a job spec, register the job and queue its launch units.

Everything Redis sees happens in one MULTI/EXEC transaction (spec, registry entry, launch
settings and every RQ launch unit), so a failure leaves no half-submitted job. The spec is
validated before any connection is made. RQ payloads carry the job id and a worker count
only: connection settings and credentials come from each node's environment.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import redis

from shoal.coordinator.launcher import enqueue_units, launch_queue, unit_sizes
from shoal.events.keys import job_keys
from shoal.core.registry import create_job
from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec
from shoal.storage.code_package import CodePackage, pack_dir


@dataclass(frozen=True)
class Submitted:
    job_id: str
    unit_ids: list[str]
    sizes: list[int]


def package_code(spec: JobSpec) -> CodePackage | None:
    """The spec's ``working_dir`` packed (ConfigError, one line, when it cannot be), or None."""
    return pack_dir(spec.working_dir, spec.working_dir_excludes) if spec.working_dir else None


def register(client: redis.Redis, spec: JobSpec, *, also=None) -> str:
    """``create_job`` with the spec's ``working_dir`` packed and stored in the same
    transaction (``shoal create``; :func:`submit` adds its launch units)."""
    package = package_code(spec)
    if package is None:
        return create_job(client, spec, also=also)
    key = job_keys(spec.name).code

    def write(pipe) -> None:
        package.write(pipe, key)
        if also is not None:
            also(pipe)

    return create_job(client, spec, also=write)


def submit(client: redis.Redis, spec: JobSpec, *, workers_per_unit: int = 1) -> Submitted:
    """Register ``spec`` (with its ``working_dir`` packed, :func:`register`) and enqueue
    launch units covering ``max_workers`` workers, ``workers_per_unit`` each (one node agent
    per unit). Raises ConfigError when the job exists; nothing is written then."""
    if workers_per_unit < 1:
        raise ValueError("workers_per_unit must be >= 1")
    per_unit = min(workers_per_unit, spec.max_workers)
    sizes = unit_sizes(spec.max_workers, per_unit)
    queue = launch_queue(client)
    queue.get_redis_server_version()  # RQ asks the server once; do it outside the transaction
    keys = job_keys(spec.name)
    ids: list[str] = []

    def also(pipe) -> None:
        pipe.hset(keys.launch, mapping={"workers": per_unit, "units": len(sizes)})
        ids.extend(enqueue_units(queue, spec.name, sizes, pipeline=pipe))

    register(client, spec, also=also)
    return Submitted(spec.name, ids, sizes)


#: What a refused check tells a ``shoal submit`` user to do when only the workers have the code.
CLI_SKIP_HINT = "pass --no-validate if only the worker nodes have it"


def check_runnable(spec: JobSpec, *, build: bool = False, isolated: bool = False, timeout: float | None = None,
                   skip_hint: str = CLI_SKIP_HINT) -> None:
    """What can be checked on the submitting machine before a job is accepted, calling no
    user code: the entrypoint imports and names a function callable with the spec's ``params``
    as keyword arguments (a missing or unexpected one is named), a
    ``tensorboard_dir`` has the ``tensorboard`` package installed, and an ``s3://``
    checkpoint, data or TensorBoard URI has its S3 settings (``S3_ENDPOINT``,
    ``S3_ACCESS_KEY``, ``S3_SECRET_KEY`` or ``S3_CREDENTIALS_FILE``). With ``build``
    (``--dry-build``) the entrypoint is also called, seeded as on a worker, and what it
    returns is checked like a worker checks it (model, optimizer, dataset...). A job with a
    ``working_dir`` is checked in a child process started there with it first on
    ``PYTHONPATH``, as its workers will be; so is one whose module is not importable here but
    lies in the current directory (``python -m shoal worker``, as agents start workers, has
    the current directory first on ``sys.path``; the ``shoal`` console script does not). ConfigError, one line naming the problem and
    ``--no-validate`` (for a job whose code or settings exist only on the worker nodes; the
    HTTP API passes its own ``skip_hint``). ``isolated`` checks every entrypoint in a child
    process (a long-running server must not import user code into itself), given at most
    ``timeout`` seconds (None: no limit)."""
    from shoal.storage.errors import StorageConfigError
    from shoal.storage.s3_config import S3Config

    skip = f"; {skip_hint}"
    if spec.entrypoint != "simulate":
        problem = _entrypoint_problem(spec.entrypoint, spec.seed, build, spec.working_dir, isolated=isolated,
                                      timeout=timeout, params=spec.params)
        if problem:
            where = f" (imported from working_dir {spec.working_dir})" if spec.working_dir else ""
            raise ConfigError(f"{problem}{where}{skip}")
    if spec.tensorboard_dir:
        from shoal.worker.tensorboard import missing_package

        missing = missing_package()
        if missing:
            raise ConfigError(f"tensorboard_dir {spec.tensorboard_dir}: the {missing} package is not installed "
                              f"(pip install 'shoal[tensorboard]'){skip}")
    for field in ("checkpoint_uri", "data_uri", "tensorboard_dir", "init_from"):
        uri = getattr(spec, field)
        if uri and uri.startswith("s3://"):
            try:
                S3Config.from_env()
            except StorageConfigError as exc:
                raise ConfigError(f"{field} {uri}: {exc}{skip}") from None
    check_checkpoints(spec, skip_hint=skip_hint)


def check_checkpoints(spec: JobSpec, *, skip_hint: str = CLI_SKIP_HINT) -> None:
    """A job's checkpoint stores, read (LATEST and manifests only) from the submitting
    machine: ConfigError, one line, when ``checkpoint_uri`` holds another job's checkpoints
    (:mod:`shoal.storage.ownership`: the line names both jobs and the fix), or when
    ``init_from`` names a store without a checkpoint whose manifest reads, or one that
    cannot be read. A ``checkpoint_uri`` that cannot be read from here is not refused (it
    may exist for the workers only; each of them checks again before it loads anything)."""
    from shoal.storage.errors import ForeignCheckpoint, StorageError
    from shoal.storage.ownership import check_owned, checkpoint_owner, missing_local
    from shoal.storage.uri import open_store

    skip = f"; {skip_hint}"
    if spec.checkpoint_uri and not missing_local(spec.checkpoint_uri):
        try:
            check_owned(open_store(spec.checkpoint_uri), spec.name)
        except ForeignCheckpoint as exc:
            raise ConfigError(str(exc)) from None
        except StorageError:
            pass
    if spec.init_from:
        where = f"init_from {spec.init_from}"
        if missing_local(spec.init_from):
            raise ConfigError(f"{where}: no such directory, so no checkpoint to start from{skip}")
        try:
            owner = checkpoint_owner(open_store(spec.init_from))
        except StorageError as exc:
            raise ConfigError(f"{where}: cannot read it: {exc}{skip}") from None
        if owner is None:
            raise ConfigError(f"{where}: the store holds no checkpoint to start from{skip}")


def _entrypoint_problem(entrypoint: str, seed: int, build: bool, working_dir: str | None, *,
                        isolated: bool = False, timeout: float | None = None, params: dict | None = None) -> str:
    """What is wrong with ``entrypoint`` called with ``params`` ("" : nothing): imported (and
    called when ``build``) here, or, with a ``working_dir`` or ``isolated``, in a child
    process run like a worker there (in the current directory when there is no
    ``working_dir``), killed after ``timeout`` s. A module that does not import here but is in
    the current directory is checked in such a child too: it imports there as it will on the
    workers, without this process's ``sys.path`` being touched."""
    from shoal.worker.errors import EntrypointError
    from shoal.worker.userapi import load_entrypoint, resolve_entrypoint

    if working_dir is None and not isolated:
        try:
            load_entrypoint(entrypoint, seed, params) if build else resolve_entrypoint(entrypoint, params)
        except EntrypointError as exc:
            if not _in_current_dir(entrypoint, exc):
                return str(exc)
        else:
            return ""
    cwd = working_dir or os.getcwd()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([cwd, *filter(None, [os.environ.get("PYTHONPATH")])]))
    argv = [sys.executable, "-m", "shoal.ops.submit", entrypoint, str(seed), json.dumps(params or {}),
            *(["--build"] if build else [])]
    try:
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"checking entrypoint {entrypoint!r} took longer than {timeout:g} s"
    if res.returncode == 0:
        return ""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else f"checking it exited with code {res.returncode}"


def _in_current_dir(entrypoint: str, exc: BaseException) -> bool:
    """Whether ``exc`` (the in-process check's failure) is the entrypoint's top-level module
    not being found, and the current directory holds it (a module or a package)."""
    top = entrypoint.partition(":")[0].split(".")[0]
    missing = exc.__cause__
    if not isinstance(missing, ModuleNotFoundError) or missing.name != top:
        return False
    return importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is not None


if __name__ == "__main__":  # the entrypoint check in a child: ENTRYPOINT SEED PARAMS_JSON [--build]
    _problem = _entrypoint_problem(sys.argv[1], int(sys.argv[2]), "--build" in sys.argv[4:], None,
                                   params=json.loads(sys.argv[3]))
    if _problem:
        print(_problem.replace("\n", " "), file=sys.stderr)
        sys.exit(2)
