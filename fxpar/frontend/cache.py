"""A Hugging Face ``StaticCache`` that torch.export takes as an input, for generation with a KV cache.

A model called with ``past_key_values=StaticCache(...)`` writes each layer's new keys and values into
fixed-size tensors in place (``index_copy_`` at the cache position, ``cumulative_length.add_``). Registered
here as a pytree node (per layer: keys, values, cumulative length), the cache's tensors become plain
user inputs of the traced graph and its in-place updates stay in it: the compiled program updates the
tensors its caller passes, and the tensor-parallel pass can keep each rank's keys and values to its own
heads (``passes/tensor_parallel/rules/cache.py``).

Only caches whose every layer is a full-attention ``StaticLayer`` qualify (sliding-window layers keep a
rolling buffer with data-dependent control flow): :func:`static_cache` returns None otherwise, and
generation runs without a cache.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

_REGISTERED = False


def _flatten(cache):
    leaves = []
    for layer in cache.layers:
        leaves += [layer.keys, layer.values, layer.cumulative_length]
    return leaves, (cache.config_ref, len(cache.layers), cache.layers[0].max_cache_len)


def _unflatten(leaves, context):
    from transformers.cache_utils import StaticCache

    ref, _, max_len = context
    cache = StaticCache(max_cache_len=max_len, config=ref.config)
    cache.config_ref = ref
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values, layer.cumulative_length = leaves[3 * i:3 * i + 3]
        if isinstance(layer.keys, torch.Tensor):  # a program's output may hold None where a value stays local
            layer.is_initialized = True
            layer.dtype, layer.device = layer.keys.dtype, layer.keys.device
            layer.max_batch_size, layer.num_heads, _, layer.head_dim = layer.keys.shape
    return cache


def _flatten_with_keys(cache):
    leaves, context = _flatten(cache)
    return [(pytree.SequenceKey(i), v) for i, v in enumerate(leaves)], context


def register() -> None:
    """Make ``StaticCache`` a pytree node (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers.cache_utils import StaticCache

    pytree.register_pytree_node(StaticCache, _flatten, _unflatten, serialized_type_name="fxpar.StaticCache",
                                flatten_with_keys_fn=_flatten_with_keys)
    _REGISTERED = True


class _ConfigRef:
    """The text config a cache was built from, compared by identity (a pytree context must compare)."""

    def __init__(self, config):
        self.config = config

    def __eq__(self, other):
        return isinstance(other, _ConfigRef) and other.config is self.config

    def __hash__(self):
        return id(self.config)

    def __repr__(self):
        return f"config<{type(self.config).__name__}>"


def static_cache(model: torch.nn.Module, batch: int, max_len: int, device) -> object | None:
    """An initialised ``StaticCache`` for ``model``: ``batch`` rows, ``max_len`` positions, zeros; None when the
    model's cache would not be all full-attention static layers, or the model takes no ``past_key_values``."""
    import inspect

    from transformers.cache_utils import StaticCache, StaticLayer
    from transformers.configuration_utils import get_head_shapes

    if "past_key_values" not in inspect.signature(model.forward).parameters or not hasattr(model, "config"):
        return None
    register()
    config = model.config.get_text_config()
    try:
        cache = StaticCache(max_cache_len=max_len, config=config)
        if not cache.layers or any(type(layer) is not StaticLayer for layer in cache.layers):
            return None
        heads, head_dim = get_head_shapes(config)
        dtype = next(iter(model.parameters())).dtype
        cache.early_initialization(batch, heads, head_dim, dtype, device)
    except (AttributeError, TypeError, ValueError):  # a config transformers' caches do not describe
        return None
    cache.config_ref = _ConfigRef(config)
    return cache
