"""PEFT adapters of a compiled ``get_peft_model(...)`` model: their first values on a meta-built model, the
frozen base read per rank from the model directory, and the export PEFT's own ``save_pretrained`` writes.

* :func:`materialize`: a PEFT model wrapped around a meta-device model has its adapters on the meta device
  too; their first values are made on the CPU by PEFT's own ``reset_lora_parameters`` (A as ``nn.Linear``,
  B zero: the wrapped model starts as the base model) and returned, the model left on the meta device (a
  trace needs one device).
* :class:`AdapterWeights`: ``compile(peft_model, plan, weights=AdapterWeights(peft_model, model_dir,
  materialize(peft_model)))``. The adapters come from those values, the frozen base from the directory's
  safetensors files, read under the base model's names (PEFT's prefix ``base_model.model.`` and each adapted
  layer's ``.base_layer`` taken off); each rank reads only its slices, as ``weights=model_dir`` does.
* :func:`export_adapter`: every rank calls it; the adapters are gathered from every rank (TP shards, stages,
  ZeRO shards: ``full_state_dict(names=...)``, the adapters only) and rank 0 writes them with PEFT's
  ``save_pretrained(state_dict=...)``: ``adapter_model.safetensors`` and ``adapter_config.json``, which
  ``PeftModel.from_pretrained(base, directory)`` loads. ``merge=True`` writes, instead, the merged model in
  ``save_pretrained``'s layout (``from_pretrained`` loads it) and the adapter under ``directory/adapter``.
"""

from __future__ import annotations

import copy
import itertools
import re
from pathlib import Path

import torch
import torch.distributed as dist

from fxpar.frontend.hf import wrapped_model
from fxpar.ir.errors import PlanError
from fxpar.safetensors_check import INDEX, open_checked, weight_map
from fxpar.weights import _index, _read_slice, to_meta


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s trainable parameters (a PEFT model's adapters), tied names included."""
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]


def base_name(prefix: str, name: str) -> str:
    """The name ``name`` (a PEFT model's, under ``prefix``: ``wrapped_model(model)[1]``) has in the model PEFT
    wraps: the prefix and each adapted layer's ``.base_layer`` taken off."""
    return name.removeprefix(prefix).replace(".base_layer.", ".")


def materialize(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The first values of ``model``'s LoRA adapters that are on the meta device, by name: each made on the CPU
    and initialised by PEFT (its ``reset_lora_parameters`` with the config's ``init_lora_weights``) in module
    order from the global RNG, so every rank seeded alike makes the same ones; the model's own tensors are
    put back on the meta device."""
    from peft.tuners.lora import LoraLayer

    made = []
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        for adapter, config in model.peft_config.items():
            parts = [d[adapter] for d in (module.lora_A, module.lora_B) if adapter in d]
            if not any(p.is_meta for part in parts for p in part.parameters()):
                continue
            for part in parts:
                part.to_empty(device="cpu")
            module.reset_lora_parameters(adapter, config.init_lora_weights)
            made += parts
    ids = {id(p) for part in made for p in part.parameters()}
    values = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False) if id(p) in ids}
    for part in made:
        to_meta(part)
    return values


class AdapterWeights:
    """A ``compile(..., weights=)`` source (``read_shard`` / ``read_boxes``, as a checkpoint reader) for a PEFT
    model: its adapters' first values ``adapters`` (by name), the frozen base from the safetensors files of the
    model directory ``directory``; a tensor neither holds (none: the whole base from the initialiser) is left
    to the model's initialiser."""

    def __init__(self, model: torch.nn.Module, directory: str | Path | None, adapters: dict[str, torch.Tensor]):
        self.prefix = wrapped_model(model)[1]
        unmade = [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad and n not in adapters]
        if unmade:
            raise PlanError(f"weights: no first value for the adapter {unmade[0]} ({len(unmade)} in all)",
                            fix="give the values fxpar.adapters.materialize(model) returns")
        self.adapters = adapters
        self.directory = Path(directory) if directory is not None else None
        self.where: dict[str, str] = {}  # base name -> file
        if self.directory is not None:
            index = self.directory / INDEX
            self.where = weight_map(self.directory) if index.is_file() else \
                {k: "model.safetensors" for k in open_checked(self.directory / "model.safetensors").keys()}

    def _file(self, name: str):
        base = base_name(self.prefix, name)
        if base not in self.where:
            return None, base
        return open_checked(self.directory / self.where[base]), base  # opened per tensor: nothing stays mapped

    def read_shard(self, name: str, layout, rank: int) -> torch.Tensor | None:
        """TP rank ``rank``'s part of ``name`` (``layout`` None: whole); None when neither source holds it."""
        if name in self.adapters:
            full = self.adapters[name]
            return (full if layout is None else layout.slice(full, rank)).clone()
        f, base = self._file(name)
        return None if f is None else _read_slice(f, base, layout, rank)

    def read_boxes(self, name: str, full_shape: tuple, boxes: list) -> bool:
        """Boxes ``(offsets, view)`` of ``name`` read into their views; False when neither source holds it."""
        if name in self.adapters:
            src = self.adapters[name]
        else:
            f, base = self._file(name)
            if f is None:
                return False
            src = f.get_slice(base)
        shape = tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())
        if shape != tuple(full_shape):
            raise PlanError(f"weights: {name} has shape {shape}, but the model needs {tuple(full_shape)}; the "
                            "weights belong to another configuration")
        for o, view in boxes:
            view.copy_(src[_index(o, view.shape)] if view.dim() else src[...])
        return True


def export_adapter(compiled, directory: str | Path, merge: bool = False) -> Path:
    """Write the adapters of the compiled PEFT model ``compiled`` as PEFT's ``save_pretrained`` does (every
    rank calls it; rank 0 writes). ``merge``: the merged model (PEFT's ``merge_and_unload`` on a copy on rank
    0, then ``save_pretrained``) in ``directory`` and the adapter in ``directory/adapter``: rank 0 holds the
    whole model, the other ranks one layer of it at a time. The adapter export gathers only the adapters."""
    directory, model = Path(directory), compiled.model
    if not compiled.program.info.wrapper_prefix or not hasattr(model, "peft_config"):
        raise PlanError(f"fxpar.adapters.export_adapter: {type(model).__name__} is no PEFT model "
                        "(get_peft_model(...)): export it with fxpar.checkpoint.export_hf")
    names = trainable_names(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = _gathered(compiled, list(model.state_dict(keep_vars=True)), rank) if merge else \
        compiled.full_state_dict(names=set(names))
    if rank == 0:
        adapter_dir = directory / "adapter" if merge else directory
        model.save_pretrained(str(adapter_dir), state_dict={n: state[n].cpu() for n in names})
        if merge:
            merged = copy.deepcopy(model)  # the compiled model's own module stays as it is
            merged.load_state_dict({k: v.cpu() for k, v in state.items()}, strict=False, assign=True)
            merged.merge_and_unload().save_pretrained(str(directory))
    del state
    if dist.is_initialized() and compiled.world > 1:  # the files are complete when any rank returns
        from fxpar.runtime import dist_calls

        dist_calls.barrier()
    return directory


def _gathered(compiled, names: list[str], rank: int) -> dict[str, torch.Tensor]:
    """Full tensors of ``names`` on rank 0 (empty elsewhere), gathered one layer at a time (the names up to
    their first number: ``...layers.3.``), so that the other ranks hold one layer of them at a time."""
    out: dict[str, torch.Tensor] = {}
    for _, group in itertools.groupby(names, key=lambda n: re.match(r"(.*?\.\d+\.|.*)", n)[1]):
        part = compiled.full_state_dict(names=set(group))
        if rank == 0:
            out.update(part)
    return out
