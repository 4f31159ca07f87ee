"""What fxpar needs to know of an optimizer: whether ZeRO can shard it, how many states it keeps, and
which parameter group each tensor it steps belongs to.

Parameter groups (``fxpar.compile(..., param_groups=rule)``): ``rule(fqn, param) -> dict`` gives the options
of a parameter's group (``{}``: the factory's defaults); parameters with equal options share a group. The
groups are the model's, not a rank's: :class:`ParamGroups` lists them in order of first appearance in
``model.named_parameters()``, the same on every rank, so that a checkpoint's per-group hyperparameters
(``fxpar.checkpoint``, by position) fit under any plan. A rank then hands its optimizer factory every
group, in that order, each with the tensors of it this rank steps (its parameters, TP shards or ZeRO flat
shards; possibly none) in torch's form ``[{"params": [...], **options}, ...]``. ZeRO buckets never mix
groups, so each flat shard lies in one. :func:`decay_rule` is HF Trainer's weight-decay split.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

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


# ---- parameter groups --------------------------------------------------------------------------------

# Trainer.get_decay_parameter_names' name patterns (matched on the lower-cased FQN)
_NO_DECAY_NAMES = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
# what Trainer's ``nn.LayerNorm`` type test catches beyond those names: a norm module's 1-D weight, in HF's
# naming ``ln_1`` / ``ln_f`` / ``ln_attn`` (GPT-2, Falcon, BLOOM, GPT-J, ...) or ``...norm...``
_NORM_MODULE = re.compile(r"(?:^|_)ln(?:_|\d|$)|norm")


def decay_rule(weight_decay: float) -> Callable[[str, torch.Tensor], dict]:
    """``param_groups=`` rule of HF Trainer: ``{"weight_decay": weight_decay}`` for every parameter but biases
    and normalisation weights, which get ``{"weight_decay": 0.0}``. Keyed on the FQN and the shape only:
    Trainer's own name patterns, plus the 1-D ``weight`` of a module named like a norm, which its
    ``nn.LayerNorm`` type test catches (``tests/runtime/test_param_groups.py`` checks that it agrees with
    ``Trainer.get_decay_parameter_names`` on every zoo model)."""
    weight_decay = float(weight_decay)

    def rule(fqn: str, param: torch.Tensor) -> dict:
        module, _, leaf = fqn.lower().rpartition(".")
        norm_weight = leaf == "weight" and param.dim() == 1 and bool(_NORM_MODULE.search(module.rpartition(".")[2]))
        return {"weight_decay": 0.0 if _NO_DECAY_NAMES.search(fqn.lower()) or norm_weight else weight_decay}
    return rule


class ParamGroups:
    """The model's parameter groups: every group's options, in order, and the group of every FQN (tied
    aliases included). Built once, before any communication, by :meth:`from_rule`."""

    def __init__(self, options: list[dict], index: dict[str, int]):
        self.options, self._index = options, index

    @classmethod
    def from_rule(cls, model: torch.nn.Module, rule) -> ParamGroups:
        """Apply ``rule(fqn, param)`` to each parameter of ``model`` once, under its canonical FQN (the first
        ``named_parameters`` gives; a tied parameter is one); meta tensors are fine."""
        if not callable(rule):
            raise PlanError(f"fxpar.compile: param_groups={rule!r} is not callable; give a function "
                            "(fqn, param) -> dict of the group's options, e.g. fxpar.ir.optim.decay_rule(0.01)")
        options: list[dict] = []
        index: dict[str, int] = {}
        canonical: dict[int, str] = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            if id(p) in canonical:
                index[fqn] = index[canonical[id(p)]]
                continue
            canonical[id(p)] = fqn
            got = rule(fqn, p)
            if not isinstance(got, Mapping) or not all(isinstance(k, str) for k in got) or "params" in got:
                raise PlanError(f"fxpar.compile: param_groups rule gave {got!r} for {fqn}; it must return a dict "
                                "of the group's options with string keys and no 'params' (e.g. "
                                "{'weight_decay': 0.0}; {} for the optimizer's defaults)", module=fqn)
            got = dict(got)
            if got not in options:
                options.append(got)
            index[fqn] = options.index(got)
        if not options:
            raise PlanError(f"fxpar.compile: param_groups given, but {type(model).__name__} has no parameter")
        return cls(options, index)

    def __len__(self) -> int:
        return len(self.options)

    def index(self, fqn: str) -> int:
        """The group of the parameter ``fqn`` (any of its names)."""
        try:
            return self._index[fqn]
        except KeyError:
            raise PlanError(f"fxpar.ir.optim: {fqn!r} is no parameter of the model the param_groups rule saw; "
                            "compile the model whose parameters the rule was applied to") from None

    def torch_form(self, tensors: Sequence[torch.Tensor], groups: Sequence[int]) -> list[dict]:
        """``[{"params": [...], **options}, ...]``: every group in order, with those of ``tensors`` in it
        (``groups[i]`` is ``tensors[i]``'s group); a group with none has an empty list."""
        out = [{"params": [], **opts} for opts in self.options]
        for t, g in zip(tensors, groups, strict=True):
            out[g]["params"].append(t)
        return out


def make_optimizer(factory, tensors: Sequence[torch.Tensor], groups: ParamGroups | None = None,
                   which: Sequence[int] | None = None):
    """``factory`` over what this rank steps: ``tensors`` as a plain list without ``groups``, else torch's
    group form with every group of the model (``which[i]``: the group of ``tensors[i]``); None when this rank
    steps nothing."""
    if factory is None or not tensors:
        return None
    return factory(list(tensors)) if groups is None else factory(groups.torch_form(tensors, which))
