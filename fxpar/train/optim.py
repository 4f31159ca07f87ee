"""The optimizer and learning-rate schedule of a fine-tuning run, as HF Trainer sets them up.

* AdamW (torch's) with Trainer's defaults (betas 0.9 / 0.999, eps 1e-8); with ``weight_decay`` > 0 the
  parameters go into Trainer's two groups (``fxpar.ir.optim.decay_rule``: biases and normalisation
  weights undecayed), passed to ``fxpar.compile(..., param_groups=)`` so that every plan (ZeRO flat
  shards included) keeps them apart.
* The schedule is ``transformers.get_scheduler`` (``constant``, ``linear``, ``cosine``, ... each with
  warm-up) on the compiled model's optimizer; it is stepped once per optimizer step and its state goes
  into the checkpoint. A rank whose stages hold no parameter has no optimizer: it follows the same
  schedule on a stand-in so that every rank logs the same learning rate.
"""

from __future__ import annotations

import warnings

import torch

from fxpar.ir.errors import PlanError

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
             "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay")


def adamw_factory(lr: float, weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8):
    """``optimizer=`` for ``fxpar.compile``: AdamW over what fxpar hands it (parameters, ZeRO shards or
    param groups)."""
    def factory(params):
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return factory


def param_groups_rule(weight_decay: float):
    """``param_groups=`` for ``fxpar.compile``: Trainer's decay / no-decay split, or None without decay."""
    if not weight_decay:
        return None
    from fxpar.ir.optim import decay_rule

    return decay_rule(weight_decay)


def warmup_steps(warmup: float, total: int) -> int:
    """``--warmup``: a number of steps (>= 1) or a fraction of the run (< 1), as Trainer's
    ``warmup_steps`` / ``warmup_ratio``."""
    if warmup < 0:
        raise PlanError(f"--warmup {warmup}: give a number of steps or a fraction of the {total} steps in [0, 1)")
    return int(warmup) if warmup >= 1 else int(round(warmup * total))


def check_schedule(name: str, warmup: float, total: int) -> None:
    """``--lr-scheduler`` / ``--warmup`` checked before anything else runs."""
    if name not in SCHEDULES:
        raise PlanError(f"--lr-scheduler {name!r}: one of {', '.join(SCHEDULES)}")
    warmup_steps(warmup, total)


def load_schedule(scheduler, state: dict) -> None:
    """Put ``scheduler`` at the step a saved scheduler's ``state`` had reached, and its optimizer's groups at
    that step's rates. The saved per-group rates are the saving rank's: a rank of another plan (another
    pipeline stage, or none with trainable parameters) has other groups, so where their number differs only
    the position in the schedule carries over and the rates are this rank's own at that position."""
    groups = scheduler.optimizer.param_groups
    if len(state.get("base_lrs", ())) != len(groups):
        state = {k: v for k, v in state.items() if k in ("last_epoch", "_step_count")}
        scheduler.load_state_dict({**scheduler.state_dict(), **state})
        with warnings.catch_warnings():  # get_lr() outside step(): the rates at the loaded position
            warnings.simplefilter("ignore")
            scheduler._last_lr = scheduler.get_lr()
    else:
        scheduler.load_state_dict(state)
    for group, rate in zip(groups, scheduler.get_last_lr()):
        group["lr"] = rate


def make_scheduler(optimizer, name: str, warmup: int, total: int, lr: float):
    """``transformers.get_scheduler(name, ...)`` on ``optimizer`` (a stand-in when this rank has none)."""
    from transformers import get_scheduler

    check_schedule(name, warmup, total)
    if optimizer is None:  # this rank steps no parameter; it still follows (and logs) the schedule
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    kwargs = {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}} if name == "cosine_with_min_lr" else {}
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total, **kwargs)
