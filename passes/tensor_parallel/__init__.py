"""Tensor parallelism as a graph pass: placements, collectives and local shapes for one TP rank.

Reads: ``fxpar.module``, ``fxpar.param``, ``val``; the plan's styles (module FQN globs -> style).
Writes: ``fxpar.placement`` (``(Shard(d),)``, ``(Replicate(),)``, ``(Partial(),)``) on every node,
``fxpar.cost`` priced again on local shapes (a sharded op costs its shard), ``torch.ops.fxpar.*`` collective nodes, local sizes in view-like ops, and a per-rank :class:`Program`
bound to this rank's shards (fresh Parameters holding slices of the model's tensors).

Rules (Megatron): a column-parallel linear shards its weight and bias by output features, takes a
replicated input through ``identity_fwd_all_reduce_bwd`` (inserted once per input value) and yields
``Shard(-1)``; a row-parallel linear shards its weight by input features, takes ``Shard(-1)`` and
all-reduces its output (bias added after). Placements then flow through ATen ops: elementwise ops keep
a shard (a replicated operand that is not broadcast along the sharded dim is sliced locally, without
communication), view/reshape map a shard of a merged dim to its leading factor, transpose/permute move
it, reductions and softmax over other dims keep it, attention keeps a shard of the heads dim. Any other
op gets replicated inputs (gathered): correct, and visible to the collective counter. Vocabulary-
parallel embeddings do a masked local lookup and an all-reduce. An MLP at tp=2, before and after::

    up = linear(x, up_w)                 f = identity_fwd_all_reduce_bwd(x, "tp:0,1")
    act = silu(up)                       up = linear(f, up_w)          # up_w [I/2, H]: Shard(-1) out
    down = linear(act, down_w)           act = silu(up)                # Shard(-1)
    return down                          down = linear(act, down_w)    # down_w [H, I/2]: Partial()
                                         out = all_reduce(down, "tp:0,1")
                                         return out                    # Replicate()

Parts: :mod:`.styles` (which modules are cut how), :mod:`.layouts` (fused and transposed weights, dim
arithmetic), :mod:`.rewriter` (the environment and placement helpers), :mod:`.rules` (one rule per op
family, in a table).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.cost.flops import annotate_costs
from fxpar.ir import meta
from fxpar.ir.placement import ShardLayout, TpResult
from fxpar.ir.program import ParamInfo, Program
from fxpar.passes.tensor_parallel.rewriter import REPLICATE, Rewriter
from fxpar.passes.tensor_parallel.styles import STYLES, check_heads, infer_styles, resolve_styles

__all__ = ["STYLES", "ShardLayout", "TpResult", "infer_styles", "resolve_styles", "tensor_parallel"]


def tensor_parallel(program: Program, tp: int, rank: int, styles: dict[str, str] | None = None,
                    group: str | None = None, shards: dict[str, torch.Tensor] | None = None,
                    keep_outputs: set[int] | None = None, sequence_parallel: bool = False) -> tuple[Program, TpResult]:
    """This rank's program: sharded parameters, collectives in the graph, local shapes.

    ``group``: the name the collectives carry; its size must be readable from it (``"tp:0,1"``, the
    default: ranks ``0..tp-1``) or registered where the program runs. ``shards``: this rank's shard
    tensors by FQN from an earlier call (another traced signature of the same model, e.g. inference
    after training), bound again instead of slicing the model's tensors; new shards are added to it.
    ``keep_outputs``: positions of the graph outputs still needed (a training step needs only the
    loss: the logits then stay sharded and are never gathered); the others become None.
    ``sequence_parallel``: between blocks (norms, residual adds, dropout) activations are sharded along
    the sequence; row-parallel outputs are reduce-scattered and column-parallel inputs gathered
    (Megatron's sequence parallelism), same communication volume, 1/tp of those activations.
    """
    group = group if group is not None else "tp:" + ",".join(map(str, range(tp)))
    shards = {} if shards is None else shards
    plan = styles if styles is not None else program.info.tp_plan
    resolved = resolve_styles(program, plan, strict=styles is not None) if plan else infer_styles(program)
    sequence_parallel = sequence_parallel or "sequence_parallel" in resolved.values()
    check_heads(program, resolved, tp)
    rw = Rewriter(program, resolved, tp, rank, group, keep_outputs=keep_outputs, sequence_parallel=sequence_parallel)
    graph = rw.run()
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule(program.gm, graph)
    pieces = {fqn: rw.segments[fqn] for fqn in rw.param_dim if fqn in rw.segments}
    result = TpResult(dict(rw.param_dim), pieces, list(rw.fallbacks), tp)
    tensors, params = {}, {}
    for fqn, info in program.params.items():
        t = program.tensor(fqn)
        layout = result.layout(fqn)
        if layout is not None:
            if fqn not in shards:
                piece = layout.slice(t.detach(), rank)
                shards[fqn] = torch.nn.Parameter(piece, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else piece
            t = shards[fqn]
            info = ParamInfo(info.fqn, tuple(t.shape), info.dtype, info.requires_grad, info.is_buffer, info.aliases)
        tensors[fqn], params[fqn] = t, info
    local = Program(gm, inputs=program.inputs, outputs=program.outputs, in_spec=program.in_spec,
                    out_spec=program.out_spec, params=params, tensors=tensors, constants=program.constants,
                    info=program.info, frontend=program.frontend, root=program.root)
    _refresh_vals(local)
    annotate_costs(local)  # the rewritten nodes are new: price them on this rank's shapes
    for node in gm.graph.nodes:
        node.meta[meta.PLACEMENT] = (rw.place.get(node, REPLICATE),)
    return local, result


def _refresh_vals(program: Program) -> None:
    """Recompute every node's ``val`` with local shapes (FakeTensorProp over the rewritten graph). The
    collectives' fake kernels read their group's size from its name (or its registration)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    phs = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    bound = {b.placeholder: b for b in program.inputs}
    fakes = []
    users = [n.meta.get(meta.VAL) for n in phs if bound[n.name].kind == "user"]
    device = next((v.device for v in users if isinstance(v, torch.Tensor)), None)
    for n in phs:
        b = bound[n.name]
        if b.kind in ("parameter", "buffer"):
            t = program.tensor(b.target).detach()
            # a meta-traced program may already hold some real shards: shapes are what matter here
            fakes.append(mode.from_tensor(t.to(device) if device is not None and t.device != device else t))
        else:
            v = n.meta.get(meta.VAL)
            if isinstance(v, torch.Tensor):
                with mode:
                    v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            fakes.append(v)
    FakeTensorProp(program.gm, mode).propagate_dont_convert_inputs(*fakes)
