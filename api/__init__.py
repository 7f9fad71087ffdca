"""shoal: elastic, fault-tolerant data-parallel PyTorch training coordinated only through Redis.

What a training script needs comes from here::

    from shoal import TrainingSetup

    def build() -> TrainingSetup:
        ...

To try a ``build()`` out in one process, without Redis or workers (the examples' local mode,
``python -m shoal.examples.digits``), drive its setup with the same engine and data order
the workers use::

    from shoal import DataOrder, StepEngine, load_entrypoint

    setup = load_entrypoint("mymodule:build", seed)
    engine = StepEngine.from_setup(setup, require_group=False)
    order = DataOrder(len(setup.dataset), seed, global_batch)
    batch = order.batch(cursor)  # the global batch at a sample cursor
    result = engine.step(batch.indices, batch.count, generation=0)
    cursor = batch.next_cursor

A step there is the step a job of any world size takes at that cursor (the loss summed over
the global batch); ``engine.evaluate(setup.eval_fn)`` gives the held-out metrics.

The rest of the package is laid out in layers that only import downwards:

* ``shoal.events`` and ``shoal.core``: the wire contract (key names, TTLs, stream caps, event
  models, the stream bus) and the core (errors, Redis connection, job spec, job registry,
  fault plans);
* ``shoal.storage``: checkpoints, the LATEST pointer, dataset files;
* ``shoal.coordinator`` and ``shoal.worker``: the control plane's decisions and loop; the
  worker's membership, heartbeats, generation switch and step engine, and the node agent;
* ``shoal.ops``: operator tooling (CLI, demo, chaos soak, report, submit and launch, metrics,
  status);
* ``shoal.examples``: the runnable examples (``shoal.examples.digits:build``).

``shoal.envvars`` names every ``SHOAL_*`` environment variable shoal reads, with its meaning and
default (the examples' own knobs among them).

The names below are imported on first use, so ``import shoal`` stays cheap (no torch) for
the CLI and the control plane.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("shoal")
except PackageNotFoundError:  # pragma: no cover - running from a tree that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_EXPORTS = {
    "TrainingSetup": "shoal.worker.userapi",
    "load_entrypoint": "shoal.worker.userapi",
    "seed_everything": "shoal.worker.userapi",
    "EntrypointError": "shoal.worker.errors",
    "JobSpec": "shoal.core.jobspec",
    "load_spec": "shoal.core.jobspec",
    "ShoalError": "shoal.core.errors",
    "ConfigError": "shoal.core.errors",
    "StreamingDataset": "shoal.storage.streaming",
    "StepEngine": "shoal.worker.engine",
    "DataOrder": "shoal.worker.data",
    # a module: every SHOAL_* environment variable, with its meaning and default
    "envvars": "shoal.events",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from shoal.core.errors import ConfigError, ShoalError
    from shoal.core.jobspec import JobSpec, load_spec
    from shoal.events import envvars
    from shoal.storage.streaming import StreamingDataset
    from shoal.worker.data import DataOrder
    from shoal.worker.engine import StepEngine
    from shoal.worker.errors import EntrypointError
    from shoal.worker.userapi import TrainingSetup, load_entrypoint, seed_everything


def __getattr__(name: str) -> Any:
    """PEP 562: resolve a public name on first access and cache it in the module."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    try:
        value = getattr(import_module(module), name)
    except AttributeError:  # a module of that package, not imported yet (``envvars``)
        value = import_module(f"{module}.{name}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
