"""Which layout a job trains with: the one place that reads the spec's ``shard_size`` and ``sync``
(:mod:`shoal.worker.layout` has the protocol and the options every layout reads)."""

from __future__ import annotations

from shoal.core.faults import FaultPlan
from shoal.core.jobspec import JobSpec
from shoal.worker.layout import GroupSettings, Layout, LayoutOptions
from shoal.worker.layout_diloco import Diloco
from shoal.worker.layout_dp import DataParallel
from shoal.worker.layout_hsdp import Hsdp
from shoal.worker.userapi import TrainingSetup


def layout_for(spec: JobSpec) -> type:
    """The layout class of ``spec``: the one place that reads which layout a job uses."""
    if spec.diloco_options is not None:
        return Diloco
    return Hsdp if spec.shard_size > 1 else DataParallel


def make_layout(spec: JobSpec, setup: TrainingSetup, options: LayoutOptions, groups: GroupSettings,
                faults: FaultPlan) -> Layout:
    """The layout of ``spec`` for ``setup`` (see :func:`layout_for`)."""
    return layout_for(spec).from_setup(setup, options, groups, faults)


def prepare_process(spec: JobSpec, device_type: str) -> None:
    """What a layout needs of the process before the user's model is built (see each
    layout's ``prepare_process``)."""
    layout_for(spec).prepare_process(device_type)
