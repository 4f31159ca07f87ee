"""A resumed run's learning-rate schedule: the saved position carries over to a rank whose optimizer has other
parameter groups than the saving rank's (a pipeline stage with no trainable parameter under another plan)."""

from __future__ import annotations

import torch

from fxpar.train import optim


def _scheduler(groups: int, steps: int):
    params = [torch.zeros(1, requires_grad=True) for _ in range(groups)]
    sched = optim.make_scheduler(torch.optim.SGD([{"params": [p]} for p in params], lr=0.1), "linear", 2, 10, 0.1)
    for _ in range(steps):
        sched.optimizer.step()
        sched.step()
    return sched


def test_a_rank_with_other_groups_resumes_at_the_saved_step():
    saved = _scheduler(2, 4).state_dict()  # two groups (decayed and not), step 4 of a 2-step warm-up, 10 steps
    other = optim.make_scheduler(None, "linear", 2, 10, 0.1)  # a rank that steps nothing: a one-group stand-in
    optim.load_schedule(other, saved)
    assert other.last_epoch == 4 and other.get_last_lr() == [0.1 * (10 - 4) / (10 - 2)]
    assert other.optimizer.param_groups[0]["lr"] == other.get_last_lr()[0]
    other.optimizer.step()
    other.step()  # (zip of another rank's two base rates against its one group failed here)
    assert other.get_last_lr() == [0.1 * (10 - 5) / (10 - 2)]


def test_the_same_groups_load_the_saved_state_as_it_was():
    saved = _scheduler(2, 3)
    again = _scheduler(2, 0)
    optim.load_schedule(again, saved.state_dict())
    assert again.state_dict() == saved.state_dict()
    assert [g["lr"] for g in again.optimizer.param_groups] == saved.get_last_lr()
