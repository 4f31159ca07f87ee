"""Tensor parallelism as a graph pass: placements, collectives and local shapes for one TP rank.

Reads: ``fxpar.module``, ``fxpar.param``, ``val``; the plan's styles (module FQN globs -> style).
Writes: ``fxpar.placement`` (``(Shard(d),)``, ``(Replicate(),)``, ``(Partial(),)``) on every node,
``fxpar.cost`` priced again on local shapes (a sharded op costs its shard), ``torch.ops.fxpar.*`` collective
nodes, local sizes in view-like ops, and a per-rank :class:`Program` bound to this rank's shards (fresh Parameters
holding slices of the model's tensors).

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

Parts: :mod:`.styles` (which modules are cut how), :mod:`.layouts` (fused and transposed weights),
:mod:`.dim_moves` (where a dim goes through a view, transpose, permute or reshape: one table, read by
the rules, the inference and the packing analysis), :mod:`.rewriter` (the environment and placement
helpers), :mod:`.rules` (one rule per op family, in a table).
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.cost.flops import annotate_costs
from fxpar.ir import meta
from fxpar.ir.placement import ShardLayout, TpResult
from fxpar.ir.program import Program, graph_module
from fxpar.passes.local import bind_local
from fxpar.passes.tensor_parallel.channels import rewrite_with_channels
from fxpar.passes.tensor_parallel.reasons import gathered_params, replicated_reasons
from fxpar.passes.tensor_parallel.rewriter import REPLICATE, Rewriter
from fxpar.passes.tensor_parallel.styles import STYLES, check_heads, infer_styles, resolve_styles, styles_for

__all__ = ["STYLES", "ShardLayout", "TpResult", "infer_styles", "resolve_styles", "tensor_parallel"]


def tensor_parallel(program: Program, tp: int, rank: int, styles: dict[str, str] | None = None,
                    group: str | None = None, shards: dict[str, torch.Tensor] | None = None,
                    keep_outputs: set[int] | None = None, sequence_parallel: bool = False,
                    replicate: tuple[str, ...] = ()) -> tuple[Program, TpResult]:
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
    # a model's plan + inferred for the rest, with the modules asked for whole kept whole
    resolved = styles_for(program, plan, tp, user=styles is not None, replicate=replicate)
    sequence_parallel = sequence_parallel or "sequence_parallel" in resolved.values()
    check_heads(program, resolved, tp)
    rw, graph = rewrite_with_channels(lambda derived: Rewriter(
        program, resolved, tp, rank, group, keep_outputs=keep_outputs, sequence_parallel=sequence_parallel,
        derived=derived))
    graph.eliminate_dead_code()
    gm = graph_module(program.gm, graph)
    pieces = {fqn: rw.segments[fqn] for fqn in rw.param_dim if fqn in rw.segments}
    result = TpResult(dict(rw.param_dim), pieces, list(rw.fallbacks), tp)
    result.whole = {fqn: w for fqn, w in rw.packing.whole.items() if fqn in pieces}  # pieces every rank holds whole
    result.sizes = {fqn: program.params[fqn].shape[d] for fqn, d in rw.param_dim.items()}  # uneven cuts need them
    # why each parameter left whole is whole, and which cut ones a rule gathers again (fxpar inspect shows them)
    result.replicated = replicated_reasons(program, rw.param_dim, resolved, rw.transposed, rw.segments, tp,
                                           rw.why_whole)
    result.gathered = gathered_params(graph, rw.param_dim)
    local = bind_local(program, gm, shards,
                       lambda fqn, t: None if result.layout(fqn) is None else result.layout(fqn).slice(t, rank))
    annotate_costs(local)  # the rewritten nodes are new: price them on this rank's shapes
    for node in gm.graph.nodes:
        node.meta[meta.PLACEMENT] = (rw.place.get(node, REPLICATE),)
    return local, result

