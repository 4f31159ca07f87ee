"""``fxpar train --lora r=16``: the model wrapped by PEFT's own ``LoraConfig`` / ``get_peft_model`` before it is
compiled, so only the adapters train (the frozen base gets no gradient, no optimizer state, no reduction).

* ``--lora r=N`` (or ``--lora N``): the adapters' rank. ``--lora-alpha`` (PEFT's default when not given: 8),
  ``--lora-dropout`` (PEFT's: 0), ``--lora-targets q_proj,v_proj`` (module names, or PEFT's ``all-linear``;
  not given: PEFT's own targets for the model type, ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``).
  Every one of them, and the targets against the model's modules, is checked before any rank communicates.
* On a meta-built model (a model directory, ``--meta``, a resumed run) the adapters are made and initialised
  by PEFT on the CPU (:func:`fxpar.adapters.materialize`) and the frozen base is read per rank from the
  directory (:class:`fxpar.adapters.AdapterWeights`).
* ``--export DIR`` writes the adapter as PEFT's ``save_pretrained`` does; with ``--merge`` the merged model
  in DIR and the adapter in DIR/adapter (:func:`fxpar.adapters.export_adapter`).
* Checkpoints (``--save``) hold the adapters, their AdamW states and the frozen base, under PEFT's names:
  ``--resume`` reads the whole model from the checkpoint under any plan, as for a full fine-tune.
"""

from __future__ import annotations

import math
import re

import torch

from fxpar.ir.errors import InputError, PlanError

SPEC = re.compile(r"(?:r=)?(\d+)")
FIX = "give --lora r=N with N a positive integer, e.g. --lora r=16"


def rank_of(spec: str) -> int:
    """The rank ``--lora`` gives (``r=16`` or ``16``); anything else is a :class:`PlanError`."""
    m = SPEC.fullmatch(spec.strip())
    if m is None or int(m[1]) < 1:
        raise PlanError(f"--lora {spec!r}: not a LoRA rank", fix=FIX)
    return int(m[1])


def targets_of(spec: str | None) -> list[str] | str | None:
    """``--lora-targets``: a comma-separated list of module names, PEFT's ``all-linear``, or None (PEFT's)."""
    if spec is None:
        return None
    if spec.strip() == "all-linear":
        return "all-linear"
    names = [t.strip() for t in spec.split(",")]
    if not all(names):
        raise PlanError(f"--lora-targets {spec!r}: an empty module name",
                        fix="give module names separated by commas, e.g. --lora-targets q_proj,v_proj")
    return names


def check_options(a) -> None:
    """The LoRA options on their own and together (before anything is read)."""
    lora = getattr(a, "lora", None)
    given = [f for f, v in (("--lora-alpha", a.lora_alpha), ("--lora-targets", a.lora_targets),
                            ("--lora-dropout", a.lora_dropout), ("--merge", a.merge)) if v not in (None, False)]
    if lora is None:
        if given:
            raise PlanError(f"{given[0]} without --lora: the LoRA options need --lora r=N", fix=FIX)
        return
    rank_of(lora)
    targets_of(a.lora_targets)
    if a.lora_alpha is not None and not (math.isfinite(a.lora_alpha) and a.lora_alpha > 0):
        raise PlanError(f"--lora-alpha {a.lora_alpha}: give a positive number (the adapters' scale is alpha / r)")
    if a.lora_dropout is not None and not 0 <= a.lora_dropout < 1:
        raise PlanError(f"--lora-dropout {a.lora_dropout}: give a probability in [0, 1)")
    if a.merge and not a.export:
        raise PlanError("--merge without --export: give --export DIR, where the merged model is written")


def linear_names(model: torch.nn.Module) -> list[str]:
    """The names (last FQN part) of ``model``'s linear layers, which LoRA can target, in module order."""
    from transformers.pytorch_utils import Conv1D

    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)):
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def lora_config(a, model: torch.nn.Module, base_path: str | None = None):
    """PEFT's ``LoraConfig`` of the options ``a`` for ``model``; a model type PEFT has no default targets for,
    without ``--lora-targets``, is an :class:`InputError` naming the type, the model's linear layers and the fix."""
    from peft import LoraConfig
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    targets = targets_of(a.lora_targets)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if targets is None and model_type not in DEFAULTS:
        found = linear_names(model)
        raise InputError(f"--lora: PEFT has no default target modules for model type {model_type!r}; the model's "
                         f"linear layers are {', '.join(found)}", path=a.model,
                         fix=f"name the layers to adapt: --lora-targets {','.join(found[:2]) or 'NAME,NAME'} "
                             "(or all-linear)")
    options = {"lora_alpha": a.lora_alpha, "lora_dropout": a.lora_dropout}
    return LoraConfig(r=rank_of(a.lora), target_modules=targets, task_type="CAUSAL_LM",
                      base_model_name_or_path=base_path, **{k: v for k, v in options.items() if v is not None})


def wrap(model: torch.nn.Module, a, base_path: str | None = None) -> tuple[torch.nn.Module, dict]:
    """``get_peft_model(model, lora_config(...))`` and, where the model is on the meta device, its adapters'
    first values made by PEFT on the CPU (:func:`fxpar.adapters.materialize`; else an empty dict). Targets
    the model does not have are an :class:`InputError` listing its linear layers."""
    from peft import get_peft_model

    from fxpar.adapters import materialize

    config = lora_config(a, model, base_path)
    try:
        wrapped = get_peft_model(model, config)
    except ValueError as e:  # PEFT's words for targets it does not find
        raise InputError(f"--lora-targets {a.lora_targets}: {e}", path=a.model,
                         fix=f"the model's linear layers are {', '.join(linear_names(model))}") from None
    return wrapped, materialize(wrapped)


def check_checkpoint(a, model: torch.nn.Module, reader) -> None:
    """The checkpoint ``reader`` (``checkpoint.model_source``) resumed from holds every adapter of this run
    (a LoRA run's, with the same targets) or, without ``--lora``, none: a tensor it lacks would otherwise be
    drawn from the initialiser."""
    from fxpar.adapters import trainable_names

    saved = {k[len("model."):] for k in reader.keys("model.")} | set(reader.aliases)
    adapters = sorted(k for k in saved if ".lora_" in k)
    if not a.lora:
        if adapters:
            raise PlanError(f"--resume {reader.path} is a LoRA run's checkpoint (PEFT's names, e.g. {adapters[0]})",
                            fix="resume it with --lora and the LoRA options it was trained with")
        return
    names = trainable_names(model)
    missing = [n for n in names if n not in saved]
    if missing:
        what = "other --lora-targets" if adapters else "no --lora (a full fine-tune's checkpoint)"
        raise PlanError(f"--resume {reader.path} holds no {missing[0]} ({len(missing)} of this run's {len(names)} "
                        f"adapters missing): it was saved by a run with {what}",
                        fix="resume with the --lora options it was trained with" if adapters else
                            "--export the full fine-tune and start LoRA from that directory")
