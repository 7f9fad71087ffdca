"""The user API: what a training job's ``entrypoint: module:function`` must return.

The function returns a :class:`TrainingSetup`. It is called with the job spec's ``params`` as
keyword arguments (none by default: ``params: {lr: 3e-4}`` calls ``build(lr=3e-4)``)::

    from shoal import TrainingSetup

    def build(lr: float = 0.1) -> TrainingSetup:
        model = torch.nn.Sequential(...)
        return TrainingSetup(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=lr),
            dataset=MyDataset(),                                  # map-style: len() + [i]
            loss_fn=torch.nn.CrossEntropyLoss(reduction="sum"),  # SUM over the samples
        )

Contracts the runtime relies on:

* ``dataset`` is map-style (``__len__``, ``__getitem__(int)``) and identical on every worker;
  ``dataset[i]`` returns something ``torch.utils.data.default_collate`` (or ``collate_fn``)
  can batch, by default an ``(input, target)`` pair.
* ``loss_fn(outputs, targets)`` returns the **sum** of the per-sample losses of the batch
  (``reduction="sum"``), not the mean: the runtime adds the sums of all ranks and divides by
  the global batch size, which is what makes training independent of the world size.
* Or, instead of ``loss_fn``, ``step_fn(model, batch)`` returns that sum for a collated
  micro-batch, for models whose forward is not ``model(inputs)``.
* ``eval_fn(model)`` (optional) returns metrics, e.g. ``{"accuracy": 0.97}``; it must not
  use collectives (it runs on one worker).
* Model, optimizer and scheduler must be built deterministically from the seeded RNGs (no
  reading of wall-clock or per-host state): :func:`load_entrypoint` seeds ``random``, numpy
  and torch before calling ``build`` so that every worker starts from identical weights
  (they are also synchronised by a state broadcast when a generation forms).
* Randomness inside the forward pass (dropout) and batch statistics (BatchNorm) make a step
  depend on how the batch is split, so such models are not world-size invariant.
"""

from __future__ import annotations

import importlib
import inspect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.worker.errors import EntrypointError


@dataclass
class TrainingSetup:
    """Everything the runtime needs to train one job. See the module docstring."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    dataset: Any  # map-style torch Dataset: __len__ and __getitem__(int)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    lr_scheduler: Any | None = None  # stepped once per committed step
    eval_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    #: Largest number of samples one forward/backward pass handles; bigger local slices are
    #: split and their gradients accumulated. None: the whole local slice at once.
    micro_batch: int | None = None
    #: The job spec's ``loader_workers`` / ``prefetch_steps`` for this dataset instead (None:
    #: the spec's), e.g. ``loader_workers=0`` - one loader thread - for a dataset that cannot
    #: be forked or pickled (see :mod:`shoal.worker.prefetch`).
    loader_workers: int | None = None
    prefetch_steps: int | None = None
    #: Elastic HSDP (the job's ``shard_size`` > 1): the submodules each sharded as one unit
    #: (``fully_shard``: its parameters gathered for its forward and backward only), given the
    #: model; the root is sharded last. None: each child of the root that holds parameters,
    #: and each element of a child container (``ModuleList``, ``Sequential``, ``ModuleDict``).
    shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None
    #: Tokens in one sample (a language model's sequence length), when a sample is a sequence
    #: of tokens: ``shoal status``, the report and TensorBoard then show tokens/s (samples/s x
    #: this). None: no tokens/s.
    tokens_per_sample: int | None = None
    #: Distributed evaluation: a map-style dataset split across the members like the training
    #: data (each evaluates its part, in batches of ``eval_batch_size``, and the sums are
    #: all-reduced), so the metrics are the same at every world size and the time an evaluation
    #: takes drops as members are added. Reported as ``val_<name>``: a sum divided by the
    #: number of samples. ``eval_sums(model, batch)`` gives a batch's sums, ``{name: scalar
    #: tensor}`` (e.g. ``{"loss": summed loss, "accuracy": correct count}``); None: ``{"loss":
    #: loss_fn(model(inputs), targets)}`` (or ``step_fn(model, batch)``). It runs when
    #: ``eval_fn`` does (``eval_every_steps``/``eval_every_epochs``, and at the end), beside it.
    eval_dataset: Any = None
    eval_sums: Callable[[torch.nn.Module, Any], dict[str, torch.Tensor]] | None = None
    eval_batch_size: int = 64

    def validate(self, where: str = "TrainingSetup") -> None:
        """Raise EntrypointError naming the first field that breaks the contract."""
        if not isinstance(self.model, torch.nn.Module):
            raise EntrypointError(f"{where}: model must be a torch.nn.Module, got {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise EntrypointError(
                f"{where}: optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}"
            )
        if (self.loss_fn is None) == (self.step_fn is None):
            raise EntrypointError(f"{where}: give exactly one of loss_fn and step_fn")
        for name in ("loss_fn", "step_fn", "eval_fn", "collate_fn", "eval_sums"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise EntrypointError(f"{where}: {name} must be callable")
        if not (hasattr(self.dataset, "__len__") and hasattr(self.dataset, "__getitem__")):
            raise EntrypointError(f"{where}: dataset must be map-style (define __len__ and __getitem__)")
        if len(self.dataset) <= 0:
            raise EntrypointError(f"{where}: dataset is empty")
        if self.eval_dataset is not None and not (hasattr(self.eval_dataset, "__len__")
                                                  and hasattr(self.eval_dataset, "__getitem__")):
            raise EntrypointError(f"{where}: eval_dataset must be map-style (define __len__ and __getitem__)")
        if not isinstance(self.eval_batch_size, int) or isinstance(self.eval_batch_size, bool) or self.eval_batch_size <= 0:
            raise EntrypointError(f"{where}: eval_batch_size must be a positive int, got {self.eval_batch_size!r}")
        if self.micro_batch is not None and self.micro_batch <= 0:
            raise EntrypointError(f"{where}: micro_batch must be positive, got {self.micro_batch}")
        if self.tokens_per_sample is not None and (not isinstance(self.tokens_per_sample, int)
                                                   or isinstance(self.tokens_per_sample, bool)
                                                   or self.tokens_per_sample <= 0):
            raise EntrypointError(f"{where}: tokens_per_sample must be a positive int (or None), "
                                  f"got {self.tokens_per_sample!r}")
        for name in ("loader_workers", "prefetch_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 64):
                raise EntrypointError(f"{where}: {name} must be an int from 0 to 64 (or None: the job spec's), "
                                      f"got {value!r}")
        model_params = {id(p) for p in self.model.parameters()}
        opt_params = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if not opt_params <= model_params:
            raise EntrypointError(f"{where}: the optimizer holds tensors that are not parameters of the model")


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, numpy's global RNG and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def resolve_entrypoint(entrypoint: str, params: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Import ``module:function`` and return the function, calling nothing: what ``submit``
    and ``create`` check before they accept a job. EntrypointError (one line naming the
    entrypoint and the problem) when the string is malformed, the module cannot be imported
    (the import error is chained), the attribute is missing, not callable, or cannot be
    called with ``params`` as keyword arguments (:func:`params_problem`: the argument that is
    missing or unexpected is named)."""
    module_name, sep, fn_name = entrypoint.partition(":")
    if not sep or not module_name or not fn_name or ":" in fn_name:
        raise EntrypointError(f"entrypoint {entrypoint!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntrypointError(f"entrypoint {entrypoint!r}: cannot import {module_name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised at import time
        raise EntrypointError(
            f"entrypoint {entrypoint!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise EntrypointError(f"entrypoint {entrypoint!r}: module {module_name!r} has no attribute {fn_name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EntrypointError(f"entrypoint {entrypoint!r}: {fn_name!r} is not callable")
    problem = params_problem(obj, params or {})
    if problem:
        raise EntrypointError(f"entrypoint {entrypoint!r}: {problem}")
    return obj


def params_problem(fn: Callable[..., Any], params: Mapping[str, Any]) -> str:
    """Why ``fn(**params)`` cannot be called ("" : it can), naming the first argument at
    fault: one that ``fn`` needs and ``params`` lacks, one that ``params`` gives and ``fn``
    does not take (it takes no ``**kwargs``), or one that only goes by position. A callable
    without a readable signature (some builtins) passes: the call itself will tell."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    kinds = inspect.Parameter
    args = list(sig.parameters.values())
    bare = sig.replace(parameters=[a.replace(annotation=kinds.empty) for a in args], return_annotation=kinds.empty)
    shown = f"{getattr(fn, '__name__', 'the function')}{bare}"
    for a in args:
        if a.default is kinds.empty and a.kind is kinds.POSITIONAL_ONLY:
            return f"{shown} needs its positional-only argument {a.name!r}: params are passed by keyword"
        if a.default is kinds.empty and a.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY) \
                and a.name not in params:
            return (f"missing argument {a.name!r}: {shown} has no default for it; set it under params: in the "
                    f"job spec (or --set params.{a.name}=VALUE)")
    if any(a.kind is kinds.VAR_KEYWORD for a in args):
        return ""
    takes = {a.name for a in args if a.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    for name in params:
        if name not in takes:
            return f"unexpected argument {name!r} in params: {shown} takes no argument of that name"
    return ""


def load_entrypoint(entrypoint: str, seed: int, params: Mapping[str, Any] | None = None) -> TrainingSetup:
    """Import ``module:function`` (:func:`resolve_entrypoint`), seed every RNG with ``seed``,
    call the function with ``params`` (the job spec's) as keyword arguments, validate.

    Raises EntrypointError (one line naming the entrypoint and the problem) as
    :func:`resolve_entrypoint` does, and when the call raises or the result is not a valid
    TrainingSetup.
    """
    obj = resolve_entrypoint(entrypoint, params)
    seed_everything(seed)
    try:
        setup = obj(**(params or {}))
    except Exception as exc:  # noqa: BLE001 - user code
        raise EntrypointError(f"entrypoint {entrypoint!r} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(setup, TrainingSetup):
        raise EntrypointError(
            f"entrypoint {entrypoint!r} returned {type(setup).__name__}, expected shoal.TrainingSetup"
        )
    setup.validate(f"entrypoint {entrypoint!r}")
    return setup

