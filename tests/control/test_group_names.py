"""A failed rendezvous leaves the next group's name where every member expects it (real Redis,
real gloo). torch names the default group by a per-process counter that a failed
``init_process_group`` bumps and does not reset: members that failed a rendezvous and members
that never tried it then wait for each other's keys under different names, and no later
generation forms (seen in the chaos soak: 80 generations in a row could not form)."""

from __future__ import annotations

import pytest
import redis
from torch.distributed import distributed_c10d as c10d

from shoal.worker import process_group as pg
from shoal.worker.errors import WorkerError


def test_a_failed_rendezvous_resets_the_group_name_counter(r: redis.Redis, job_id: str) -> None:
    rendezvous = pg.Rendezvous(r, job_id, backend="gloo")
    with pytest.raises(WorkerError):  # rank 1 never comes
        rendezvous.join(1, 0, 2, 1.0)
    assert c10d._world.group_count == 0
    group = rendezvous.join(2, 0, 1, 5.0)
    try:
        assert group.generation == 2
        names = {k.decode() for k in r.scan_iter(match=f"shoal:{{{job_id}}}:rdzv:2:*")}
        assert names and all(n.split(":rdzv:2:", 1)[1].split(":", 1)[-1].startswith("0//") for n in names), names
    finally:
        rendezvous.close_joined()
