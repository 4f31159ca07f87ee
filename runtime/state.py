"""The full state of a compiled model on every rank: parameters (or their gradients) under the
original FQNs, gathered from TP shards, ZeRO-3 shards and the pipeline ranks that hold them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxpar.ir.mesh import MeshSpec
from fxpar.ir.stage import CompileResult
from fxpar.runtime.groups import resolve_group


def full_state_dict(result: CompileResult, model: torch.nn.Module, mesh: MeshSpec, device: torch.device,
                    grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors keyed by the original FQNs (tied parameters under each name), on every rank.
    ``grads=True``: the parameters' gradients from the last step instead (zeros where none).

    TP shards are gathered within the owning stage's TP group, then sent from its TP rank 0. ZeRO-3
    shards must have been gathered into the parameters first (``fxpar.runtime.zero3.sync_zero3``).
    """
    pipeline, program = result.pipeline, result.program
    owner: dict[str, int] = {}
    for stage in pipeline.stages:
        for fqn in stage.params + stage.buffers:
            owner.setdefault(fqn, stage.rank)
    out = {}
    named = dict(model.named_parameters(remove_duplicate=False)) if grads else model.state_dict(keep_vars=True)
    for name, value in named.items():
        try:
            fqn = program.canonical(name)
        except KeyError:  # a tensor the traced graph does not bind
            fqn = name
        local = program.tensor(fqn) if fqn in program.params else value
        if grads:
            local = local.grad if local.grad is not None else torch.zeros_like(local)
        layout = result.tp.layout(fqn)
        shape = list(local.shape)
        if layout is not None:
            shape[layout.dim] *= mesh.tp
        mine = owner.get(fqn, mesh.pp_rank) == mesh.pp_rank
        if layout is not None and mine:
            parts = [torch.empty_like(local) for _ in range(mesh.tp)]
            dist.all_gather(parts, local.detach().contiguous(), group=resolve_group(mesh.group_name("tp")))
            full = layout.unshard(parts)
        else:
            full = local.detach().clone() if mine else torch.empty(shape, dtype=local.dtype, device=device)
        if mesh.world_size > 1 and fqn in owner:
            dist.broadcast(full, src=owner[fqn] * mesh.tp)
        out[name] = full
    return out
