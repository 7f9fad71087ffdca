"""The chaos soak (``shoal chaos``): faults at random against a real job, then its end state.

``inject`` (what each fault does and when it is allowed), ``sampler`` (LATEST validity and
Redis footprint while it runs), ``verdict`` (the end-state checks and the table), ``run``
(the processes and the fault loop). ``shoal chaos --network``: ``network`` (the soak across
network namespaces, with network faults), on ``netns`` (the namespace harness, which the
multi-host tests use too) and ``delayfwd`` (its user-space delay line).
"""

from shoal.ops.chaos.run import ChaosConfig, run_chaos

__all__ = ["ChaosConfig", "run_chaos"]
