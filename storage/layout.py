"""Names of the objects a checkpoint store holds (object keys, not Redis keys).

    LATEST                              JSON {"step": N, "checkpoint": "step-00000000N", ...}
    step-000000123/model.pt             torch.save'd state files ...
    step-000000123/optimizer.pt
    step-000000123/manifest.json        written last; the checkpoint exists iff it verifies

A store is rooted at one job's checkpoint location (``s3://bucket/jobs/JOB``), so these
names carry no job id.
"""

from __future__ import annotations

import re

from shoal.events.models import CHECKPOINT_DIR_PREFIX as DIR_PREFIX
from shoal.events.models import checkpoint_dir

LATEST = "LATEST"
MANIFEST = "manifest.json"

_DIR = re.compile(r"^step-(\d{9,})$")

__all__ = ["DIR_PREFIX", "LATEST", "MANIFEST", "checkpoint_dir", "file_key", "manifest_key", "step_of_dir"]


def file_key(step: int, name: str) -> str:
    """Key of the file ``name`` inside the checkpoint of ``step``."""
    return f"{checkpoint_dir(step)}/{name}"


def manifest_key(step: int) -> str:
    return file_key(step, MANIFEST)


def step_of_dir(name: str) -> int | None:
    """The step of a checkpoint directory name, or None if ``name`` is not one."""
    m = _DIR.match(name)
    return int(m.group(1)) if m else None


def step_of_key(key: str) -> int | None:
    """The step of the checkpoint holding ``key`` (``step-000000007/x.pt`` -> 7), else None."""
    head, sep, _rest = key.partition("/")
    return step_of_dir(head) if sep else None
