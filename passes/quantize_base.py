"""QLoRA's base: each frozen weight a linear or embedding reads held as int8 blocks, dequantized when it runs
(``Plan(base_dtype="int8")``; ``"nf4"``: 4-bit NormalFloat blocks, :mod:`fxpar.ir.nf4`, the same with ``nf4`` for
``int8`` in every name below).

Reads: the stage's ``get_attr`` nodes and the tensors they name (after TP's cut and the weights' load: each
rank quantizes the shard it holds, so blocks never straddle two ranks' shards). Writes: per frozen floating
``[out, in]`` parameter whose every reader is ``aten.linear`` as its weight or ``aten.embedding`` as its table
(an input embedding, tied to the LM head or not), two buffers beside it on the stage's module (``<name>_int8``
codes, ``<name>_int8_scales``, :func:`fxpar.ir.quant_ops.quantize_rows`) and each reader replaced by
``fxpar_kernels.int8_linear`` / ``int8_embedding`` over them; the parameter leaves the stage, and
``ctx.program``, the shared TP shards and loaded weights keep a meta stand-in (its shape, for later
signatures), so the rank holds codes and scales only. ``ctx.shared["quantized_base"]`` maps each FQN to its
codes and scales, reused by every signature and stage of the rank.

Under ZeRO-3 the frozen weights are still on meta here (``materialize_weights`` leaves parameters to zero3):
each is read whole (this rank's TP shard, ``ctx.load``) one at a time, quantized and dropped; the zero3 pass
then shards the codes and scales over dp in frozen buckets of their own (:func:`held_names`: gathered as held,
never cast nor requantized for the wire, never reduce-scattered) and :func:`release` drops the whole ones.

A frozen weight read by anything else (DoRA's weight norm, a matmul on a view of it) stays in full precision.
"""

from __future__ import annotations

import torch

from fxpar.ir import quant_ops
from fxpar.ir.errors import PlanError
from fxpar.ir.stage import StageSpec
from fxpar.passes.pipeline_split import set_nested

_LINEAR = torch.ops.aten.linear.default
_EMBEDDING = torch.ops.aten.embedding.default


def _attr(root: torch.nn.Module, fqn: str):
    mod = root
    for p in fqn.split("."):
        mod = getattr(mod, p, None)
        if mod is None:
            return None
    return mod


def quantizable(node: torch.fx.Node, t, loadable: bool = False) -> bool:
    """Whether ``node`` (a ``get_attr`` of ``t``) is a frozen floating matrix read only as a linear's weight or
    an embedding's table (on meta only where ``loadable``: its weights can be read)."""
    return (isinstance(t, torch.nn.Parameter) and not t.requires_grad and t.is_floating_point() and t.dim() == 2
            and (loadable or not t.is_meta) and len(node.users) > 0
            and all((u.target == _LINEAR and len(u.args) >= 2 and u.args[1] is node
                     and node not in (u.args[0], *u.args[2:]))
                    or (u.target == _EMBEDDING and u.args[0] is node and node not in u.args[1:])
                    for u in node.users))


def quantize_base(stage: StageSpec, ctx) -> StageSpec:
    gm, fmt = stage.gm, ctx.plan.base_dtype
    quantize = quant_ops.FORMATS[fmt][0]
    linear_op = getattr(torch.ops.fxpar_kernels, f"{fmt}_linear").default
    embedding_op = getattr(torch.ops.fxpar_kernels, f"{fmt}_embedding").default
    done = ctx.shared.setdefault("quantized_base", {})
    tp_shards, loaded = ctx.shared.get("tp_shards", {}), ctx.shared.get("loaded", {})
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        fqn = node.target
        t = _attr(gm, fqn)
        if fqn not in done:
            if not quantizable(node, t, ctx.load is not None):
                continue
            if t.is_meta:  # under ZeRO-3 (materialize_weights leaves parameters to zero3): read whole, quantized
                t = ctx.load(list(ctx.program.params[fqn].fqns), ctx.out.tp.layout(fqn), like=t).to(ctx.device)
            done[fqn] = (*quantize(t), t.shape[1])
            stand_in = torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=False)
            ctx.program.set_tensor(fqn, stand_in)
            for held in (tp_shards, loaded):  # no reference to the full-precision tensor is left
                if fqn in held:
                    held[fqn] = stand_in
        codes, scales, in_features = done[fqn]
        set_nested(gm, f"{fqn}_{fmt}", codes)
        set_nested(gm, f"{fqn}_{fmt}_scales", scales)
        *path, last = fqn.split(".")
        delattr(_attr(gm, ".".join(path)) if path else gm, last)
        with gm.graph.inserting_before(node):
            q = gm.graph.get_attr(f"{fqn}_{fmt}")
            s = gm.graph.get_attr(f"{fqn}_{fmt}_scales")
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                if user.target == _EMBEDDING:  # padding_idx and the rest only shape a gradient the table has not
                    new = gm.graph.call_function(embedding_op, (q, s, user.args[1], in_features))
                else:
                    x, _, *bias = user.args
                    new = gm.graph.call_function(linear_op, (x, q, s, bias[0] if bias else None, in_features))
            new.meta = dict(user.meta)
            user.replace_all_uses_with(new)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return stage


def _base_of(name: str, fmt: str) -> str:
    return name.removesuffix("_scales").removesuffix(f"_{fmt}")


def held_names(gm: torch.fx.GraphModule, ctx) -> list[str]:
    """The codes and scales ``gm`` reads (``<fqn>_int8``, ``<fqn>_int8_scales``; ``_nf4``): ZeRO-3 shards them
    over dp with the parameters, gathered as held (``passes/zero3.py``'s ``held``)."""
    done = ctx.shared.get("quantized_base", {})
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and _base_of(n.target, ctx.plan.base_dtype) in done]


def release(ctx, names: list[str]) -> None:
    """After ZeRO-3 sharded the codes and scales ``names``: the rank keeps meta stand-ins (their shapes, for
    later signatures, which find the buckets in zero3's cache), not the whole tensors."""
    done = ctx.shared.get("quantized_base", {})
    for fqn in {_base_of(n, ctx.plan.base_dtype) for n in names} & done.keys():
        codes, scales, in_features = done[fqn]
        done[fqn] = (codes.to("meta"), scales.to("meta"), in_features)


def check(program, ctx) -> None:
    """``Plan(base_dtype="int8")`` needs frozen weight matrices (a PEFT model)."""
    plan = ctx.plan
    frozen = [info.fqn for info in program.params.values()
              if not program.tensor(info.fqn).requires_grad and program.tensor(info.fqn).dim() == 2]
    if not frozen:
        raise PlanError(f"Plan(base_dtype={plan.base_dtype!r}): the model has no frozen weight matrix to quantize "
                        "(every parameter trains)",
                        fix="wrap the model with PEFT (get_peft_model / fxpar train --lora r=N) or drop base_dtype")
