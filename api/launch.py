"""The RQ entry point of a launch unit.

Every queued unit stores the dotted name of the function RQ runs for it
(``coordinator.launcher.LAUNCH_FUNC == "shoal.launch.run_launch"``), so that name is part of
the wire format and stays here, whatever module implements it (``shoal.ops.launch``).
"""

from shoal.ops.launch import run_launch

__all__ = ["run_launch"]
