"""Real tensors for the meta ones of this rank's stages, cut for its TP rank.

Reads: the stage's parameter and buffer FQNs, ``ctx.out.tp`` (which weights TP shards, and how).
Writes: the tensors into ``ctx.program`` and the stage's ``GraphModule`` (the same object in both), and
into ``ctx.shared["tp_shards"]`` so every signature of the compiled model computes with them.

The policy (a state dict, safetensors files or the model's initialiser) arrives as ``ctx.load``, a
callback the caller builds (``fxpar.weights.WeightSource.load``): the pass decides *what* this rank
needs, the callback *where it comes from*. A tensor loaded for one signature is reused by the next, and by
every other stage of this rank that reads it (virtual stages: a rotary table's buffer in stages 0 and 2).
Under ZeRO-3 the trainable parameters are left on meta: the zero3 pass reads only this rank's slice of
each (``ctx.load_flat``), so no rank ever holds a full parameter it does not own.
"""

from __future__ import annotations

import torch

from fxpar.ir.stage import StageSpec
from fxpar.passes.pipeline_split import set_nested


def zero3_shards(ctx, t: torch.Tensor) -> bool:
    """Whether the zero3 pass will flatten ``t`` into a bucket (a parameter, trainable or frozen, under ZeRO-3)."""
    return ctx.plan.zero == 3 and isinstance(t, torch.nn.Parameter)


def materialize_weights(stage: StageSpec, ctx) -> StageSpec:
    program = ctx.program
    loaded = ctx.shared.setdefault("loaded", {})  # FQN -> tensor materialised for this rank
    tp_shards = ctx.shared.setdefault("tp_shards", {})
    for fqn in stage.params + stage.buffers:
        t = program.tensor(fqn)
        if fqn not in loaded:
            if not t.is_meta:  # the model's own tensor
                continue
            if zero3_shards(ctx, t):  # the zero3 pass reads only this rank's slice of it
                continue
            layout = ctx.out.tp.layout(fqn)
            v = ctx.load(list(program.params[fqn].fqns), layout, like=t).to(ctx.device)
            loaded[fqn] = torch.nn.Parameter(v, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else v
        v = loaded[fqn]
        program.set_tensor(fqn, v)
        if fqn in tp_shards:
            tp_shards[fqn] = v
        set_nested(stage.gm, fqn, v)
    return stage
