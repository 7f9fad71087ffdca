"""Root of shoal's exception hierarchy.

Every package (events, coordinator, worker, storage) derives its own errors from
:class:`ShoalError`; outside errors (redis-py, minio, torch) are translated at one place
per package with ``raise ... from``. The CLI turns a ShoalError into a one-line message
and a non-zero exit; anything else is a bug and keeps its traceback.
"""


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose. ``exit_code`` is the CLI exit status."""

    exit_code = 1


class ConfigError(ShoalError):
    """Bad user input: a job spec, cluster file, URL or option. Nothing was changed."""

    exit_code = 2


class ConnectionFailed(ShoalError):
    """A server (Redis, S3) could not be reached or refused us. The message names which."""

    exit_code = 3
