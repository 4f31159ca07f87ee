"""A trace runs without the model's KV cache unless the call asks for it.

A Hugging Face config keeps ``use_cache=True`` as ``from_pretrained`` gives it: it is the switch
``generate`` relies on. Traced with it, a forward that is given no ``past_key_values`` builds a fresh
``DynamicCache`` and returns it, which torch.export cannot take as an output (and HFTracer cannot trace).
Such a cache is of no use to the caller of a compiled program either: the program has no input to feed
it back through, and fxpar's generation (``fxpar.runtime.generate``) passes its own static cache as
``past_key_values`` with ``use_cache=True``. So the rule, read from the call alone:

* the call gives ``past_key_values`` (not None), or passes ``use_cache=True`` itself: the trace keeps the
  cache, as asked;
* otherwise (training with labels, evaluation logits, a call that passes ``use_cache=False``): every
  config the model's modules hold (``module.config``, and its text config) with a true ``use_cache`` is
  set to False for the duration of the trace and restored after it, failure or not.

Models whose forward takes no ``use_cache`` (BERT) read it from the config when they read it at all, so
the config is the switch that reaches them too; a model with no ``config`` is left as it is. The graph
is the one HF's own ``model(..., use_cache=False)`` runs, which is also the one where transformers looks
for packed sequences in ``position_ids`` (it skips that when a cache exists). ``symbolic_trace`` does the
same for HFTracer.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch

__all__ = ["call_values", "keeps_cache", "cache_off_for_trace"]


def call_values(model: torch.nn.Module, example_args: tuple, example_kwargs: dict) -> dict[str, Any]:
    """The call's arguments by the names ``model.forward`` gives them (positional ones bound by order)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {**dict(zip(names, example_args)), **example_kwargs}


def keeps_cache(values: dict[str, Any]) -> bool:
    """Whether a call with these arguments traces with the KV cache (see the module docstring)."""
    return values.get("past_key_values") is not None or values.get("use_cache") is True


def _configs(model: torch.nn.Module) -> list[Any]:
    """Every distinct config object the model's modules hold, with their text configs, in module order."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "use_cache"):
            continue
        seen.setdefault(id(config), config)
        text = getattr(config, "get_text_config", None)
        if callable(text):
            try:
                sub = text()
            except Exception:  # a config that cannot name its text part: itself is enough
                sub = None
            if sub is not None and hasattr(sub, "use_cache"):
                seen.setdefault(id(sub), sub)
    return list(seen.values())


@contextlib.contextmanager
def cache_off_for_trace(model: torch.nn.Module, values: dict[str, Any]) -> Iterator[list[Any]]:
    """Within the block, ``use_cache`` is False on every config of ``model`` that had it true, unless the
    call (``values``, by parameter name) keeps the cache; restored on exit, on failure too. Yields the
    configs it turned off."""
    saved = []
    for config in [] if keeps_cache(values) else _configs(model):
        value = config.use_cache
        if not value:
            continue
        try:
            config.use_cache = False
        except (AttributeError, TypeError):  # a read-only use_cache: the model decides, as before
            continue
        saved.append((config, value))
    try:
        yield [config for config, _ in saved]
    finally:
        for config, value in saved:
            config.use_cache = value
