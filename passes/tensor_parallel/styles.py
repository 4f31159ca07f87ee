"""Tensor-parallel styles: which modules are cut how, from a plan or inferred from the graph.

Reads: the program's module and parameter FQNs, ``fxpar.module`` and the linear-like nodes of the graph,
the model config's head counts. Writes nothing.

Style names are those of transformers' ``base_model_tp_plan`` (and the issue's user plans). The pass
needs from a style only how the module's parameters are cut; what happens between layers follows from
the graph (a "gather_output" or "split_input" variant gathers only where a consumer needs it).
"""

from __future__ import annotations

import fnmatch
import operator

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import is_pointwise, packet
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.layouts import linear_weight

aten = torch.ops.aten

COLWISE = frozenset({"colwise", "colwise_gather_output", "packed_colwise"})  # output features
ROWWISE = frozenset({"rowwise", "rowwise_split_input", "packed_rowwise"})  # input features
VOCAB = frozenset({"vocab_parallel", "embedding_rowwise"})  # embedding rows (the vocabulary)
EMBEDDING_COLWISE = frozenset({"embedding_colwise"})  # embedding columns (hidden features)
# markers: parameters stay whole (a replicated parameter that meets a sharded value gets its gradient
# all-reduced by the graph rule anyway; an MoE experts module's output is a partial sum by the rules)
MARKERS = frozenset({"replicate", "replicated_with_grad_allreduce", "moe_tp_experts", "local_params",
                     "mla_kv_a_proj", "sequence_parallel"})
STYLES = tuple(sorted(COLWISE | ROWWISE | VOCAB | EMBEDDING_COLWISE | MARKERS))


def resolve_styles(program: Program, plan: dict[str, str], strict: bool = True) -> dict[str, str]:
    """Module (or parameter) FQN -> style, from globs over FQNs; unknown styles and empty globs are
    errors. ``strict=False`` (a model's own plan): entries with a style this pass does not know are
    left out, so those modules stay replicated."""
    names = [n for n, _ in program.root.named_modules()] if program.root is not None else []
    if program.root is not None:
        names += [n for n, _ in program.root.named_parameters()]
    out: dict[str, str] = {}
    for glob, style in plan.items():
        if style not in STYLES:
            if not strict:
                continue
            raise PlanError(f"tensor-parallel style {style!r} for {glob!r} is unknown; styles: {', '.join(STYLES)}")
        hits = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        if not hits and not strict:  # a model's plan covers layer variants this config may not build
            continue
        if not hits:
            near = sorted({".".join(n.split(".")[:3]) for n in names if n})[:10]
            raise PlanError(f"tensor-parallel plan entry {glob!r} matches no module; modules include {near}")
        for n in hits:
            out[n] = style
    return out


# ops a column-parallel output flows through on its way to the next linear (infer_styles)
_CARRIERS = {aten.view, aten.reshape, aten._unsafe_view, aten.transpose, aten.permute, aten.unsqueeze,
             aten.contiguous, aten.alias, aten.clone, aten.to, aten._to_copy, aten.dropout, aten.expand,
             aten.scaled_dot_product_attention, aten.matmul, aten.softmax, aten._softmax, aten.chunk, aten.split,
             aten.split_with_sizes, aten.slice, aten.index, aten.cat, aten.flatten, aten.broadcast_to, aten.squeeze}
_CACHE_WRITES = {aten.index_copy_, aten.index_copy}  # keys/values written into a KV cache, read by attention


def infer_styles(program: Program) -> dict[str, str]:
    """A column/row plan from the graph, for models without one: a linear whose output reaches, through
    views, transposes, elementwise ops and attention only, other linears is column-parallel, and those
    are row-parallel. A wrong guess costs only speed: the pass gathers where a shard cannot go on."""
    styles: dict[str, str] = {}
    for node in program.graph.nodes:
        if linear_weight(node)[0] is None or node.meta.get(meta.MODULE) in styles:
            continue
        ends, ok, seen, todo = [], True, set(), list(node.users)
        while todo and ok:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            if linear_weight(user)[0] is not None:
                ends.append(user)
            elif packet(user) in _CARRIERS or user.target is operator.getitem or (user.op == "call_function"
                                                                                   and is_pointwise(user)):
                todo.extend(user.users)
            elif packet(user) in _CACHE_WRITES:  # the cache itself is returned: only its readers matter
                todo.extend(u for u in user.users if u.op != "output")
            else:
                ok = False
        if ok and ends and not any(e.meta.get(meta.MODULE) in styles for e in ends):
            styles[node.meta.get(meta.MODULE)] = "colwise"
            for e in ends:
                styles[e.meta.get(meta.MODULE)] = "rowwise"
    return styles


def param_dim(program: Program, fqn: str, styles: dict[str, str], transposed: set[str],
              segments: dict[str, list[int]], tp: int) -> int | None:
    """The dim parameter ``fqn`` is cut along under ``styles`` (None: kept whole). ``transposed``: weights
    laid out [in, out] (Conv1D); ``segments``: the piece sizes of fused weights, each of which must divide."""
    info = program.params[fqn]
    style = None
    for name in info.fqns:
        style = styles.get(name) or styles.get(name.rpartition(".")[0]) or style
    nd, t = len(info.shape), fqn in transposed
    d = None
    if nd == 0:  # a scalar (e.g. a normaliser buffer) is never cut
        pass
    elif style in COLWISE or style in VOCAB:  # [.., out, in] (or [in, out] for Conv1D), bias [out]
        d = 0 if nd == 1 else nd - 1 if t else nd - 2
    elif style in ROWWISE and nd >= 2:  # a row-parallel layer's bias is added after the reduction
        d = nd - 2 if t else nd - 1
    elif style in EMBEDDING_COLWISE and nd == 2:
        d = 1
    if d is not None:
        for size in segments.get(fqn, [info.shape[d]]):
            if size % tp:
                raise PlanError(f"{fqn} has {info.shape[d]} rows along dim {d}"
                                f"{f' (packed parts {segments[fqn]})' if fqn in segments else ''}, "
                                f"not divisible by tp={tp}; module {fqn.rpartition('.')[0]} cannot be "
                                f"{style}: use a tp degree that divides {size}, or mark it 'replicate'")
    return d


_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def check_heads(program: Program, styles: dict[str, str], tp: int) -> None:
    """Attention heads must divide over the TP ranks when the plan shards attention projections; key/
    value heads may be fewer than the ranks (each rank then uses a copy of its group's KV head)."""
    config = getattr(program.root, "config", None)
    attn = sorted({m.rpartition(".")[0] for m, st in styles.items() if st in COLWISE
                   and "att" in m.rpartition(".")[0].lower()})
    if config is None or not attn or tp == 1:
        return
    fix = "use a tp degree that divides it, or leave the attention projections out of tp_plan"
    for key in _HEADS:
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            ok = [d for d in range(1, heads + 1) if heads % d == 0]
            raise PlanError(f"{attn[0]}: {heads} attention heads ({key}) do not divide over tp={tp} "
                            f"(tp must be one of {ok}); {fix}")
    for key in _KV_HEADS:
        kv = getattr(config, key, None)
        if isinstance(kv, int) and kv % tp and tp % kv:
            raise PlanError(f"{attn[0]}: {kv} key/value heads ({key}) neither divide over tp={tp} nor divide it "
                            f"(each rank needs whole KV heads or a copy of one); {fix}")
