"""``init_from`` in the job spec and the checks at submit (issue 35): a warm start names a
store with a checkpoint; a job's own checkpoint_uri holding another job's checkpoints is
refused with one line naming both jobs and the fix. No Redis, no user code."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from shoal.core.errors import ConfigError
from shoal.core.jobspec import JobSpec
from shoal.ops.submit import check_checkpoints
from shoal.storage.checkpoint import save_checkpoint
from shoal.storage.local import LocalStore
from shoal.storage.train_state import TrainState
from shoal.worker.checkpoints import Restore, load_flat, restore_warm
from tests.storage.support import tiny_state


def spec(**fields) -> JobSpec:
    return JobSpec(**{"name": "b", "entrypoint": "simulate", **fields})


def test_init_from_is_a_store_uri_other_than_the_jobs_own(tmp_path) -> None:
    assert spec(init_from=f"file://{tmp_path}/a").init_from == f"file://{tmp_path}/a"
    assert spec(init_from="s3://bucket/a", init_from_optimizer=True).init_from_optimizer
    with pytest.raises(ValidationError, match="must start with file:// or s3://"):
        spec(init_from=str(tmp_path))
    with pytest.raises(ValidationError, match="must not carry credentials"):
        spec(init_from="s3://user:pw@bucket/a")
    with pytest.raises(ValidationError, match="init_from_optimizer applies to a warm start"):
        spec(init_from_optimizer=True)
    with pytest.raises(ValidationError, match="init_from is the job's own checkpoint_uri"):
        spec(init_from=f"file://{tmp_path}/a/", checkpoint_uri=f"file://{tmp_path}/a")
    # a spec stored before the fields existed reads back without them
    assert JobSpec.from_stored('{"name": "b", "entrypoint": "simulate"}').init_from is None


def test_submit_refuses_an_init_from_without_a_checkpoint(tmp_path) -> None:
    for uri, needle in ((f"file://{tmp_path}/never", "no such directory"),
                        (f"file://{tmp_path}", "holds no checkpoint")):
        with pytest.raises(ConfigError, match=needle) as refused:
            check_checkpoints(spec(init_from=uri))
        assert "\n" not in str(refused.value) and str(refused.value).startswith(f"init_from {uri}: ")
    assert not (tmp_path / "never").exists()  # the check created nothing
    save_checkpoint(LocalStore(tmp_path / "a"), tiny_state(5), job_id="a")
    check_checkpoints(spec(init_from=f"file://{tmp_path}/a"))  # another job's: that is what init_from is for


def test_submit_refuses_a_checkpoint_uri_holding_another_jobs_checkpoints(tmp_path) -> None:
    save_checkpoint(LocalStore(tmp_path / "a"), tiny_state(5), job_id="a")
    uri = f"file://{tmp_path}/a"
    with pytest.raises(ConfigError) as refused:
        check_checkpoints(spec(checkpoint_uri=uri))
    line = str(refused.value)
    assert "\n" not in line and "job 'a'" in line and "job 'b'" in line and f"init_from: {uri}" in line
    check_checkpoints(spec(name="a", checkpoint_uri=uri))  # its own: resumed
    check_checkpoints(spec(checkpoint_uri=f"file://{tmp_path}/fresh"))  # a new store
    assert not (tmp_path / "fresh").exists()
    # the fix the line names: another store, warm-started from a's
    check_checkpoints(spec(checkpoint_uri=f"file://{tmp_path}/b", init_from=uri))


def _trained(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _fresh(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


class _Engine:
    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, None


@pytest.mark.parametrize("path", ["whole", "flat"])
def test_a_warm_start_takes_the_weights_and_optionally_the_moments_never_the_hyperparameters(path) -> None:
    """Both ways a layout loads a checkpoint: a whole one into a whole model
    (``restore_warm``) and the flat path a sharded model (or a sharded checkpoint) takes
    (``load_flat``); the new job's learning rate stays its own."""
    src_model, src_opt = _trained(lr=0.5)
    state = TrainState.capture(src_model, src_opt, None, step=3, epoch=0, data_cursor=96, generation=1,
                               world_size=1).snapshot()
    src_moments = [src_opt.state[p]["exp_avg"] for p in src_model.parameters()]
    for optimizer in (False, True):
        model, opt = _fresh(lr=0.01)
        if path == "whole":
            restore_warm(state, model, opt if optimizer else None)
        else:
            load_flat(_Engine(model, opt), state, Restore(warm=True, optimizer=optimizer))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), src_model.state_dict().values()))
        assert opt.param_groups[0]["lr"] == 0.01
        moments = [opt.state[p]["exp_avg"] if p in opt.state else None for p in model.parameters()]
        if optimizer:
            assert all(torch.equal(a, b) for a, b in zip(moments, src_moments))
        else:  # fresh: no moments yet (or the zeros a fresh sharded optimizer gets)
            assert all(m is None or not m.any() for m in moments)
    # a resume (not a warm start) takes the checkpoint's hyperparameters too
    model, opt = _fresh(lr=0.01)
    load_flat(_Engine(model, opt), state)
    assert opt.param_groups[0]["lr"] == 0.5
