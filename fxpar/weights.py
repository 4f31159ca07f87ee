"""Where a rank's tensors come from: each rank materialises only the shards it holds.

``compile(model, plan, weights=...)`` with a model built on the meta device (``with torch.device("meta")``)
fills in every tensor of the stages this rank runs, already cut for its tensor-parallel rank:

* a state dict keyed by the model's own (Hugging Face) FQNs: ``{"model.layers.0.mlp.up_proj.weight": ...}``;
* safetensors files (a path or a list of paths): only this rank's slice of each tensor is read
  (``safe_open(...).get_slice``), so a rank never holds a full tensor it shards;
* ``"init"``: the model's own initialiser, one module at a time (``_init_weights`` for transformers
  models, else each module's ``reset_parameters``): a module's full tensors exist only while it is
  initialised and cut. Each module draws from a generator seeded by its FQN, so every rank (and every
  plan) gets the same values whatever the order of stages and ranks.

Tensors a state dict does not hold (transformers' non-persistent buffers such as rotary frequencies)
come from the initialiser too. With ``weights=None`` a meta model stays on meta: enough to plan,
inspect and predict, not to run.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from fxpar.ir.errors import PlanError
from fxpar.ir.placement import ShardLayout


class WeightSource:
    """The tensors of one rank, from a state dict, safetensors files or the initialiser. ``rank``: this
    rank's tensor-parallel coordinate, the part of each sharded tensor :meth:`load` returns."""

    def __init__(self, model: torch.nn.Module, weights, seed: int = 0,
                 init: Callable[[torch.nn.Module], None] | None = None, rank: int = 0):
        self.model, self.seed, self.rank = model, seed, rank
        self.state: Mapping[str, torch.Tensor] = {}
        self.files: list = []
        if isinstance(weights, (str, Path)) and str(weights) != "init" or isinstance(weights, (list, tuple)):
            from safetensors import safe_open

            paths = [weights] if isinstance(weights, (str, Path)) else list(weights)
            self.files = [safe_open(str(p), framework="pt") for p in paths]
        elif isinstance(weights, Mapping):
            self.state = weights
        elif weights != "init":
            raise PlanError(f"weights={weights!r}: give a state dict, safetensors path(s) or 'init'")
        hf_init = getattr(model, "_init_weights", None)
        self.init = init or hf_init or _reset_parameters
        self._modules: dict[str, dict[str, torch.Tensor]] = {}

    def load(self, names: list[str], layout: ShardLayout | None, like: torch.Tensor) -> torch.Tensor:
        """This rank's part of the tensor known under ``names`` (aliases of one tied tensor), cut as
        ``layout`` says (None: the whole tensor)."""
        for name in names:
            if name in self.state:
                full = self.state[name]
                full = full.detach()  # copied: training never writes into the caller's state dict
                return self._checked(name, full.clone() if layout is None else layout.slice(full, self.rank), like)
            for f in self.files:
                if name in f.keys():
                    return self._checked(name, _read_slice(f, name, layout, self.rank), like)
        name = names[0]
        path, _, leaf = name.rpartition(".")
        if path not in self._modules:
            self._modules[path] = self._init_module(path)
        full = self._modules[path][leaf]
        return full if layout is None else layout.slice(full, self.rank)

    def done(self) -> None:
        self._modules.clear()

    def _init_module(self, path: str) -> dict[str, torch.Tensor]:
        module = copy.deepcopy(self.model.get_submodule(path))  # a meta module: no memory
        module.to_empty(device="cpu", recurse=False)  # only the module's own tensors are made
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + zlib.crc32(path.encode()))
            with torch.no_grad():
                self.init(module)
        return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}

    @staticmethod
    def _checked(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if tuple(t.shape) != tuple(like.shape):
            raise PlanError(f"weights: {name} has shape {tuple(t.shape)} on this rank, but the model needs "
                            f"{tuple(like.shape)}; the state dict belongs to another configuration")
        return t.to(like.dtype)


def _reset_parameters(module: torch.nn.Module) -> None:
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def _read_slice(f, name: str, layout: ShardLayout | None, rank: int) -> torch.Tensor:
    """``rank``'s part of a safetensors entry, reading only that part (one range per fused piece)."""
    if layout is None:
        return f.get_tensor(name)
    sl = f.get_slice(name)
    shape = sl.get_shape()
    parts = []
    for start, end in layout.ranges(shape[layout.dim], rank):
        index = [slice(None)] * len(shape)
        index[layout.dim] = slice(start, end)
        parts.append(sl[tuple(index)])
    return torch.cat(parts, dim=layout.dim) if layout.pieces else parts[0]
