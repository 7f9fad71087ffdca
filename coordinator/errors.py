"""Errors of the coordinator package."""

from shoal.core.errors import ShoalError


class CoordinatorError(ShoalError):
    """Base of coordinator errors."""


class StaleEpoch(CoordinatorError):
    """A fenced write was refused: another replica took the job's lease (or ours lapsed).
    The caller must drop its cached state for the job and stop acting for it."""
