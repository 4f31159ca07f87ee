"""What fxpar needs to know of an optimizer: whether ZeRO can shard it, and how many states it keeps."""

from __future__ import annotations

import torch

from fxpar.ir.errors import PlanError

ELEMENTWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                          torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
_TWO_STATES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


def check_optimizer(optimizer: torch.optim.Optimizer, zero: int) -> None:
    """ZeRO keeps optimizer states as flat slices: exact only for updates that are elementwise."""
    if zero and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise PlanError(f"ZeRO-{zero} shards optimizer states as flat slices, which is exact only for optimizers "
                        f"that update each entry on its own; {type(optimizer).__name__} is not one of "
                        f"{[c.__name__ for c in ELEMENTWISE_OPTIMIZERS]}: use zero=0 or one of those")


def state_count(optimizer: torch.optim.Optimizer | None) -> int:
    """fp32 states per parameter entry: 2 for Adam-style optimizers, 1 for SGD with momentum, else 0."""
    if isinstance(optimizer, _TWO_STATES):
        return 2
    if optimizer is not None and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return 1
    return 0
