"""What a Hugging Face model tells about itself: TP/PP plans, base-model prefix, tied weights, blocks.

transformers >= 5 configs carry ``base_model_tp_plan`` and ``base_model_pp_plan`` keyed relative to the
base model (``layers.*.self_attn.q_proj``); head models add their own ``_tp_plan`` / ``_pp_plan`` keyed
from the root (``lm_head``). fxpar keeps every plan keyed by full FQN from the traced root, so a glob
means the same thing everywhere (``model.layers.*.self_attn.q_proj``).

Plain ``nn.Module`` models work too: every field is optional. A wrapper that exposes the model it wraps
by ``get_base_model()`` (PEFT's ``PeftModel``) is read through: the facts are the wrapped model's, its
plans keyed by the FQNs the wrapper's ``named_parameters`` give (``base_model.model.model.layers.*...``).
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.ir.program import ModelInfo


def wrapped_model(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The model a wrapper holds and its FQN prefix inside ``model`` (``model`` and "" for no wrapper).

    A wrapper is a module whose class has ``get_base_model()`` returning one of its submodules (PEFT's
    ``PeftModel``: ``base_model.model.``); nested wrappers are read through to the innermost."""
    prefix = ""
    while callable(getattr(type(model), "get_base_model", None)):
        inner = model.get_base_model()
        path = next((n for n, m in model.named_modules() if m is inner and n), None)
        if path is None:
            break
        model, prefix = inner, f"{prefix}{path}."
    return model, prefix


def _prefix_of(model: torch.nn.Module) -> str:
    """The FQN prefix of the base model inside ``model`` ("" when ``model`` is the base model)."""
    prefix = getattr(model, "base_model_prefix", None) or ""
    if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module):
        return prefix + "."
    return ""


def _merge(base: dict | None, prefix: str, own: dict | None) -> dict | None:
    if not base and not own:
        return None
    out = {prefix + k: v for k, v in (base or {}).items()}
    out.update(own or {})
    return out


def longest_module_list(model: torch.nn.Module) -> tuple[str | None, int]:
    """FQN and length of the longest ``nn.ModuleList`` (the transformer blocks in HF models).

    On a tie the first in module order wins (an encoder before its decoder).
    """
    best, best_len = None, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > best_len:
            best, best_len = name, len(mod)
    return best, best_len


def _config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    try:
        return config.to_dict()
    except Exception:  # a non-HF config object: keep what is plainly readable
        return {k: v for k, v in vars(config).items() if isinstance(v, (int, float, str, bool, type(None)))}


def read_model_info(root: torch.nn.Module) -> ModelInfo:
    model, outer = wrapped_model(root)
    config = getattr(model, "config", None)
    prefix = outer + _prefix_of(model)
    text_config = config
    if config is not None and hasattr(config, "get_text_config"):
        try:
            text_config = config.get_text_config()
        except Exception:
            text_config = config
    base_tp = getattr(text_config, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    base_pp = getattr(text_config, "base_model_pp_plan", None) or getattr(config, "base_model_pp_plan", None)
    own_tp = getattr(model, "_tp_plan", None)
    own_pp = getattr(model, "_pp_plan", None)
    if not isinstance(own_tp, dict):
        own_tp = None
    if not isinstance(own_pp, dict):
        own_pp = None
    own_tp = {outer + k: v for k, v in own_tp.items()} if own_tp else None
    own_pp = {outer + k: v for k, v in own_pp.items()} if own_pp else None
    tie = getattr(text_config, "tie_word_embeddings", getattr(config, "tie_word_embeddings", None))
    container, n_layers = longest_module_list(root)
    return ModelInfo(
        model_class=type(model).__name__,
        model_type=getattr(config, "model_type", None),
        base_model_prefix=getattr(model, "base_model_prefix", None) or None,
        wrapper_prefix=outer,
        tp_plan=_merge(base_tp, prefix, own_tp),
        pp_plan=_merge(base_pp, prefix, own_pp),
        tie_word_embeddings=tie,
        num_layers=n_layers or None,
        layer_container=container,
        config=_config_dict(config),
    )


def tensor_groups(model: torch.nn.Module) -> list[tuple[bool, list[str], torch.Tensor]]:
    """Parameters and buffers grouped by identity: ``(is_buffer, [fqn, alias...], tensor)``.

    The first FQN of a group, in ``named_parameters`` order, is the canonical one; the others are
    tied to it (the same tensor object under another name).
    """
    groups: dict[int, tuple[bool, list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), (False, [], p))[1].append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) in groups:
            groups[id(b)][1].append(name)
        else:
            groups[id(b)] = (True, [name], b)
    return list(groups.values())
