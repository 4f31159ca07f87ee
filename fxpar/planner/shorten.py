"""A shortened copy of a model for the planner: the same config with as few decoder layers as hold one
layer of each kind, so that one trace prices every layer of the full model.

The rule reads only the config and the module tree, never a model's name:

* the layer count is the text config's ``num_hidden_layers`` (through the config's ``attribute_map``:
  GPT-2's ``n_layer`` answers to it); the layers are the longest ``nn.ModuleList`` of the model;
* per-layer lists are the config fields that are lists as long as the layer count (``layer_types``,
  ``attention_layers``, ...); the copy gets the entries of the layers it keeps;
* a layer's kind is its signature: its per-layer config entries, its submodules' classes and parameter
  shapes, and the plain attributes of its submodules (``is_sliding``, ``sliding_window``), leaving out
  attributes that hold the layer's own index (``layer_idx``);
* the copy keeps the first layer of each kind (and a second layer where the model has one kind, so
  that the two traced layers can be checked equal). Where the copy's layers do not come out with the
  kinds asked for (a kind that follows from an index rule such as ``first_k_dense_replace``), the copy
  is the shortest prefix of the model that holds every kind, checked the same way; where that fails
  too, there is no copy and the planner traces the whole model.

:func:`trace_copy` traces a copy as ``fxpar.trace`` does (one sequence with labels, the loss included;
export, then hf_fx where export fails) from the planner's layer, which may not import the api.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from fxpar.cost.flops import annotate_costs
from fxpar.frontend.capture import capture_program
from fxpar.frontend.hf import longest_module_list
from fxpar.ir.program import Program

_SCALARS = (int, float, str, bool, type(None))


@dataclass
class Shortened:
    """A copy with the layers ``kept`` (indices into the full model's layers) and each full layer's kind;
    ``model`` is None where the copy would hold every layer (the kinds still hold)."""

    model: torch.nn.Module | None
    kept: list[int]  # full-model index of each of the copy's layers, in order
    kinds: list[str]  # kind of each of the full model's layers


def text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        try:
            return config.get_text_config()
        except Exception:  # a config whose text part cannot be found: the config itself
            return config
    return config


def layer_count(config) -> int | None:
    """The config's layer count (``num_hidden_layers``, or the field its ``attribute_map`` names)."""
    n = getattr(config, "num_hidden_layers", None)
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def per_layer_lists(config, n: int) -> dict[str, list]:
    """Config fields that hold one entry per layer: lists or tuples of length ``n``."""
    fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return {k: list(v) for k, v in fields.items() if isinstance(v, (list, tuple)) and len(v) == n and n > 1}


def _attributes(layer: torch.nn.Module) -> dict[str, object]:
    out = {}
    for name, mod in layer.named_modules():
        for key, value in vars(mod).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _SCALARS):
                out[f"{name}.{key}"] = value
    return out


def _structure(layer: torch.nn.Module) -> tuple:
    mods = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    params = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
    return mods, params


def signatures(layers: list[torch.nn.Module], lists: dict[str, list], index_keys: set[str] | None = None,
               indices: list[int] | None = None) -> tuple[list[tuple], set[str]]:
    """One hashable signature per layer and the attribute names that carry the layer's index (left
    out of the signature). ``indices``: each layer's index in the full model (default: its position)."""
    indices = list(range(len(layers))) if indices is None else indices
    attrs = [_attributes(layer) for layer in layers]
    if index_keys is None:
        keys = set().union(*attrs) if attrs else set()
        index_keys = {k for k in keys if len(layers) > 1 and all(
            type(a.get(k)) is int and a.get(k) == i for a, i in zip(attrs, indices))}
    out = []
    for layer, a, i in zip(layers, attrs, indices):
        own = tuple(sorted((k, v) for k, v in a.items() if k not in index_keys))
        entries = tuple((k, repr(v[i])) for k, v in sorted(lists.items()))
        out.append((entries, _structure(layer), own))
    return out, index_keys


def kind_names(sigs: list[tuple], lists: dict[str, list]) -> list[str]:
    """A name per layer: "layer" where all are alike; the entry of a per-layer list that tells the kinds
    apart one to one (``layer_types``: "sliding_attention"); else ``layer<i>`` after each kind's first layer."""
    first: dict[tuple, int] = {}
    for i, s in enumerate(sigs):
        first.setdefault(s, i)
    if len(first) == 1:
        return ["layer"] * len(sigs)
    for values in lists.values():
        named = {s: str(values[i]) for s, i in first.items()}
        if len(set(named.values())) == len(first) and not set(named.values()) & {"pre", "post"}:
            return [named[s] for s in sigs]
    return [f"layer{first[s]}" for s in sigs]


def _copy_with(model: torch.nn.Module, keep: list[int], lists: dict[str, list]) -> torch.nn.Module | None:
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = len(keep)
    for key, values in lists.items():
        setattr(text, key, [values[i] for i in keep])
    try:
        with torch.device("meta"):
            return type(model)._from_config(config).train()
    except Exception:  # the config does not build with these layers (a check of its own): no copy
        return None


def shorten(model: torch.nn.Module, min_layers: int = 0) -> Shortened | None:
    """The shortened copy of ``model`` on the meta device, at least ``min_layers`` layers (a prefix of the
    model then); its ``model`` is None where no copy is shorter than the model or the copies' layers do
    not match; None where the model has no layer count, one layer or no layer container."""
    config = text_config(model)
    n = layer_count(config) if config is not None else None
    container, length = longest_module_list(model)
    if n is None or container is None or length != n or n < 2 or not hasattr(type(model), "_from_config"):
        return None
    layers = list(model.get_submodule(container))
    lists = per_layer_lists(config, n)
    sigs, index_keys = signatures(layers, lists)
    kinds = kind_names(sigs, lists)
    first: dict[tuple, int] = {}
    for i, s in enumerate(sigs):
        first.setdefault(s, i)
    picks = sorted(first.values())
    if len(picks) == 1:
        picks.append(1)  # a second layer of the one kind, to check the two trace alike
    tries = [] if min_layers > len(picks) else [picks]
    tries.append(list(range(min(n, max(max(picks) + 1, min_layers)))))
    for keep in tries:
        if len(keep) >= n:
            return Shortened(None, list(range(n)), kinds)
        short = _copy_with(model, keep, lists)
        if short is None:
            continue
        short_container, short_len = longest_module_list(short)
        if short_container != container or short_len != len(keep):
            continue
        short_lists = {k: [v[i] for i in keep] for k, v in lists.items()}
        got, _ = signatures(list(short.get_submodule(container)), short_lists, index_keys, list(range(len(keep))))
        if got == [sigs[i] for i in keep]:
            return Shortened(short, keep, kinds)
    return Shortened(None, list(range(n)), kinds)


def trace_copy(model: torch.nn.Module, seq: int, frontend: str) -> Program:
    """Trace ``model`` on one sequence of ``seq`` tokens with labels, as ``fxpar.trace`` does (the capture
    turns the model's KV cache off for the trace: ``fxpar.frontend.kv_cache``)."""
    p = next(model.parameters(), None)
    ids = torch.zeros(1, seq, dtype=torch.long, device=p.device if p is not None else "cpu")
    program = capture_program(model, (), {"input_ids": ids, "labels": ids}, frontend=frontend)
    annotate_costs(program)
    return program


def full_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The whole model on the meta device where its config rebuilds it, else the model itself."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(type(model), "_from_config"):
        try:
            with torch.device("meta"):
                return type(model)._from_config(config).train()
        except Exception:  # not rebuildable from its config: trace the model as it is
            pass
    return model
