"""Names of the objects a checkpoint store holds (object keys, not Redis keys).

    LATEST                              JSON {"step": N, "checkpoint": "step-00000000N", ...}
    step-000000123/model.pt             torch.save'd state files ...
    step-000000123/optimizer.pt
    step-000000123/manifest.json        written last; the checkpoint exists iff it verifies

    a sharded checkpoint (elastic HSDP) instead of model.pt ...:
    step-000000123/shard-0-of-2.bin     each member's part (shard_names): its tensors' bytes
    step-000000123/shard-0-of-2.json    ... and their index
    step-000000123/optimizer-groups.pt  the replicated values (SHARDED_FILES), from member 0

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

#: the replicated files of a sharded checkpoint (component -> file name); each member of the
#: saving replica group also writes its part, :func:`shard_names`
SHARDED_FILES: dict[str, str] = {
    "optimizer_groups": "optimizer-groups.pt",
    "scheduler": "scheduler.pt",
    "rng": "rng.pt",
}

__all__ = ["DIR_PREFIX", "LATEST", "MANIFEST", "SHARDED_FILES", "checkpoint_dir", "expected_files", "file_key",
           "manifest_key", "shard_names", "step_of_dir"]


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


def shard_names(shard: int, shard_size: int) -> tuple[str, str]:
    """(data file, index file) of member ``shard`` of a replica group of ``shard_size``
    (a sharded checkpoint's part of that member)."""
    stem = f"shard-{shard}-of-{shard_size}"
    return f"{stem}.bin", f"{stem}.json"


def expected_files(shard_size: int) -> set[str]:
    """Every file name a sharded checkpoint of ``shard_size`` may list (the replicated
    ones are optional but for none)."""
    names = set(SHARDED_FILES.values())
    for k in range(shard_size):
        names.update(shard_names(k, shard_size))
    return names
