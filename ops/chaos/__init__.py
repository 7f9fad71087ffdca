"""The chaos soak (``shoal chaos``): faults at random against a real job, then its end state.

``kinds`` (the registry of fault kinds: what each does, when it is allowed, how long it is
held, what recovery it expects; how to add one), ``inject`` (the local soak's injector: the
primitives its kinds use on real processes), ``sampler`` (LATEST validity and Redis footprint
while it runs), ``verdict`` (the end-state checks and the table), ``soak`` (what both soaks
share: configuration, job, reference run, following the job, the conclusion), ``pace`` (the
pause per step that makes the job last the window), ``run`` (the local soak, and
:func:`run_chaos`, which picks the soak). ``shoal chaos --network``: ``network`` (the soak
across network namespaces, with its injector of network faults), on ``netns`` (the namespace
harness, which the multi-host tests use too) and ``delayfwd`` (its user-space delay line).
"""

from shoal.ops.chaos.run import run_chaos
from shoal.ops.chaos.soak import ChaosConfig

__all__ = ["ChaosConfig", "run_chaos"]
