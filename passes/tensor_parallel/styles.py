"""Tensor-parallel styles: which modules are cut how, from a plan or inferred from the graph.

Reads: the program's module and parameter FQNs, ``fxpar.module`` and the linear-like nodes of the graph,
the model config's head counts. Writes nothing.

Style names are those of transformers' ``base_model_tp_plan`` (and the issue's user plans). The pass
needs from a style only how the module's parameters are cut; what happens between layers follows from
the graph (a "gather_output" or "split_input" variant gathers only where a consumer needs it).

:func:`styles_for` is what the pass uses: a user's plan as given; a model's own plan completed, for the
modules it does not name, by :func:`infer_styles` (:mod:`.inference`, then the carriers walk here); no
plan, everything inferred. A dim tp does not divide is cut into ``torch.chunk``'s shares; inferred styles
whose dim is too small to give every rank a part leave their weights whole.
"""

from __future__ import annotations

import fnmatch
import operator

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import ASSERTS, CACHE_WRITES, COLUMN_CARRIERS, is_pointwise, packet
from fxpar.ir.placement import chunk_fits, chunk_sizes
from fxpar.ir.program import Program
from fxpar.passes.tensor_parallel.inference import infer_pairs
from fxpar.passes.tensor_parallel.layouts import linear_weight, node_ndim

aten = torch.ops.aten

# Every style name transformers 5.23 registers (``ALL_PARALLEL_STYLES``, used in the configs'
# ``base_model_tp_plan`` and the heads' ``_tp_plan``) maps to one of these sets. Where a variant differs
# from its base only in the layouts it asks for between modules (``colwise_gather_output`` /
# ``colwise_rep``: the output replicated; ``rowwise_split_input`` / ``rowwise_rep``: the input
# replicated), the graph decides: a shard is gathered where a consumer needs the whole tensor, a
# replicated input is sliced without communication. ``packed_*`` cut fused [gate; up] weights part by
# part (the pieces come from the graph, layouts.packed_segments).
COLWISE = frozenset({"colwise", "colwise_gather_output", "colwise_rep", "packed_colwise"})  # output features
ROWWISE = frozenset({"rowwise", "rowwise_split_input", "rowwise_rep", "packed_rowwise"})  # input features
VOCAB = frozenset({"vocab_parallel", "embedding_rowwise"})  # embedding rows (the vocabulary)
EMBEDDING_COLWISE = frozenset({"embedding_colwise"})  # embedding columns (hidden features)
# markers: the module's own parameters stay whole, the graph rules do what the style's hooks do there:
# replicate / replicated_with_grad_allreduce / local_params (a replicated parameter that meets a shard gets
# its gradient summed over the ranks by the elementwise rule); mla_kv_a_proj (the rope part that bypasses
# kv_b_proj: the same); moe_tp_experts / all_reduce (a module whose output is a partial sum: the rules keep
# it Partial() and reduce it where a consumer needs the sum); moe_identity_expert (transformers divides the
# identity expert's input by tp because its hooks sum every expert's output; here only the partial
# experts' sum is reduced, so nothing is divided); sequence_parallel (Plan.sequence_parallel turned on).
# grouped_gemm / ep_dispatch_experts name expert placement in ``base_model_ep_plan``: Plan(ep=N) places
# the experts (passes/expert_parallel.py); under TP alone they are markers.
MARKERS = frozenset({"replicate", "replicated_with_grad_allreduce", "moe_tp_experts", "local_params",
                     "mla_kv_a_proj", "sequence_parallel", "all_reduce", "moe_identity_expert", "grouped_gemm",
                     "ep_dispatch_experts"})
STYLES = tuple(s for family in (COLWISE, ROWWISE, VOCAB, EMBEDDING_COLWISE, MARKERS) for s in sorted(family))


class Styles(dict):
    """Module (or parameter) FQN -> style, as the pass uses them. ``inferred``: the keys whose style came
    from the graph rather than a plan (a cut too small for a part on every rank leaves those whole instead
    of raising); ``skipped``: module -> why a candidate the inference found stays whole (heads that do not
    divide, features too few for the ranks)."""

    def __init__(self, *args, inferred: set[str] | None = None, skipped: dict[str, str] | None = None):
        super().__init__(*args)
        self.inferred = set(inferred or ())
        self.skipped = dict(skipped or {})


def styles_for(program: Program, plan: dict[str, str] | None, tp: int, user: bool = False,
               replicate: tuple[str, ...] = ()) -> Styles:
    """The styles the pass uses. A user's plan (``user``): exactly its entries, strictly checked. A
    model's own ``base_model_tp_plan``: its entries this pass knows, plus column/row pairs, token
    embeddings and the LM head inferred from the graph for every module the plan does not name
    (shared experts, MLA's kv_b_proj, extra gates, towers). No plan: everything inferred. ``replicate``
    (``Plan.tp_replicate``): module globs kept whole, each matched module with its submodules, over
    whichever plan applies (the inference pairs the rest around them)."""
    whole = replicated_modules(program, replicate)
    if user:
        taken = {**resolve_styles(program, plan or {}, strict=True), **whole}
        return Styles({**taken, **adapter_styles(program, taken)})
    taken = resolve_styles(program, plan, strict=False) if plan else {}
    taken = {**taken, **whole}
    found = infer_styles(program, tp, {**taken, **adapter_styles(program, taken)})
    found.update(adapter_styles(program, found))  # adapters of layers whose style was inferred
    return found


def adapter_styles(program: Program, styles: dict[str, str]) -> dict[str, str]:
    """Styles of the adapters wrapped around a styled layer, cut consistently with it, keyed on the structure
    PEFT's tuner layers have (``q_proj.base_layer`` beside the module dicts ``q_proj.lora_A`` and
    ``q_proj.lora_B``), whatever their class. The wrapper's style is its ``base_layer``'s. A column-parallel
    layer (output features cut): A whole, B cut on its output features, so ``B(A(x))`` is this rank's columns
    of the update, added to the layer's with no collective. A row-parallel layer (input features cut): A cut
    on its input features, B whole, so the update is a partial sum that joins the layer's, reduced once."""
    out: dict[str, str] = {}
    for fqn, mod in program.root.named_modules() if program.root is not None else ():
        base = getattr(mod, "base_layer", None)
        pairs = [getattr(mod, k, None) for k in ("lora_A", "lora_B")]
        if not isinstance(base, torch.nn.Module) or not all(isinstance(d, torch.nn.ModuleDict) for d in pairs):
            continue
        style = styles.get(f"{fqn}.base_layer") or styles.get(fqn)
        if style in COLWISE or style in ROWWISE:
            out[f"{fqn}.base_layer"] = style
            a, b = ("replicate", "colwise") if style in COLWISE else ("rowwise", "replicate")
            for name in set(pairs[0].keys()) & set(pairs[1].keys()):
                out[f"{fqn}.lora_A.{name}"], out[f"{fqn}.lora_B.{name}"] = a, b
    return out


def replicated_modules(program: Program, globs: tuple[str, ...]) -> dict[str, str]:
    """``{fqn: "replicate"}`` for every module (and parameter) a glob of ``globs`` matches and everything
    below it; a glob that matches nothing is a PlanError naming modules near it."""
    if not globs:
        return {}
    named = resolve_styles(program, {g: "replicate" for g in globs}, strict=True, what="Plan.tp_replicate entry")
    names = [n for n, _ in program.root.named_modules()] + [n for n, _ in program.root.named_parameters()]
    return {n: "replicate" for n in names if n in named or any(n.startswith(m + ".") for m in named)}


def resolve_styles(program: Program, plan: dict[str, str], strict: bool = True,
                   what: str = "tensor-parallel plan entry") -> dict[str, str]:
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
            raise PlanError(f"{what} {glob!r} matches no module; modules include {near}")
        for n in hits:
            out[n] = style
    return out


def infer_styles(program: Program, tp: int | None = None, taken: dict[str, str] | None = None) -> Styles:
    """Styles from the graph for every module ``taken`` (a model's plan) leaves unstyled: the
    shard-following inference of :mod:`.inference` (column/row pairs, token embeddings, the LM head;
    ``tp``: what heads and features must divide by), then, for linears still whole, the carriers walk
    below (it passes convolutions and scans the first does not follow). ``taken`` is kept as given."""
    taken = dict(taken or {})
    found, skipped = infer_pairs(program, tp or 1, taken)
    whole = {k: "replicate" for k in skipped}  # heads or features that do not divide: no pair either way
    found.update({k: v for k, v in _carrier_pairs(program, {**whole, **taken, **found}).items()
                  if k not in taken and k not in found and k not in whole and k is not None})
    return Styles({**taken, **found}, inferred=set(found), skipped={k: v for k, v in skipped.items() if k not in found})


def _carrier_pairs(program: Program, taken: dict[str, str]) -> dict[str, str]:
    """A column/row plan from the graph: a linear whose output reaches, through views, transposes,
    elementwise ops and attention only, other linears is column-parallel, and those are row-parallel.
    A wrong guess costs only speed: the pass gathers where a shard cannot go on."""
    styles: dict[str, str] = dict(taken)
    for node in program.graph.nodes:
        if _weight(node) is None or _owner(node) in styles:
            continue
        ends, ok, seen, todo = [], True, set(), list(node.users)
        while todo and ok:
            user = todo.pop()
            if user in seen:
                continue
            seen.add(user)
            if _weight(user) is not None:
                ends.append(user)
            elif packet(user) in COLUMN_CARRIERS or user.target is operator.getitem or (user.op == "call_function"
                                                                                   and is_pointwise(user)):
                todo.extend(user.users)
            elif packet(user) in ASSERTS:  # a dtype check before a cast reads nothing on
                continue
            elif packet(user) in CACHE_WRITES:  # the cache itself is returned: only its readers matter
                todo.extend(u for u in user.users if u.op != "output")
            else:
                ok = False
        # consumers already row-parallel (a Mamba mixer's dt_proj feeds the out_proj in_proj feeds) agree
        if ok and ends and all(styles.get(_owner(e), "rowwise") == "rowwise" for e in ends):
            styles[_owner(node)] = "colwise"
            for e in ends:
                styles[_owner(e)] = "rowwise"
    return styles


def _weight(node: torch.fx.Node) -> torch.fx.Node | None:
    """The weight of a linear-like node, ``W @ x`` with a 2-D parameter W on the left included."""
    w = linear_weight(node)[0]
    if w is None and packet(node) is aten.matmul and isinstance(node.args[0], torch.fx.Node) \
            and node.args[0].meta.get(meta.PARAM) and node_ndim(node.args[0]) == 2:
        w = node.args[0]
    return w


def _owner(node: torch.fx.Node) -> str:
    """The module a linear-like node's style is keyed on: its own, or, for ``W @ x`` written inside a
    parent module (Mamba's ``self.dt_proj.weight @ dt``), the weight's."""
    w = linear_weight(node)[0]
    return node.meta.get(meta.MODULE) if w is not None else _weight(node).meta[meta.PARAM].rpartition(".")[0]


def param_dim(program: Program, fqn: str, styles: dict[str, str], transposed: set[str],
              segments: dict[str, list[int]], tp: int) -> int | None:
    """The dim parameter ``fqn`` is cut along under ``styles`` (None: kept whole). ``transposed``: weights
    laid out [in, out] (Conv1D); ``segments``: the piece sizes of fused weights. A size tp does not divide is
    cut unevenly (``torch.chunk``'s shares, :func:`~fxpar.ir.placement.chunk_sizes`); one too small to give
    every rank a part is an error under a plan's style, and leaves an inferred one
    (:attr:`Styles.inferred`) whole."""
    info = program.params[fqn]
    style, key = None, None
    for name in info.fqns:
        for k in (name, name.rpartition(".")[0]):
            if styles.get(k):
                style, key = styles[k], k
                break
    nd, t = len(info.shape), fqn in transposed
    d = None
    if nd == 0:  # a scalar (e.g. a normaliser buffer) is never cut
        pass
    elif style in COLWISE or style in VOCAB:  # [.., out, in] (or [in, out] for Conv1D), bias [out]
        d = 0 if nd == 1 else nd - 1 if t else nd - 2
    elif style in ROWWISE and nd >= 2:  # a row-parallel layer's bias is added after the reduction
        d = nd - 2 if t else nd - 1
        segments.pop(fqn, None)  # pieces of its output (Mamba's x_proj -> dt, B, C) are not of this dim
    elif style in EMBEDDING_COLWISE and nd == 2:
        d = 1
    if d is not None:
        for size in segments.get(fqn, [info.shape[d]]):  # a size tp does not divide is cut as torch.chunk cuts it
            if not chunk_fits(size, tp) and key in getattr(styles, "inferred", ()):
                return None
            if not chunk_fits(size, tp):
                ok = [k for k in range(1, 2 * tp + 1) if chunk_fits(size, k)]
                raise PlanError(f"{fqn} has {info.shape[d]} rows along dim {d}"
                                f"{f' (packed parts {segments[fqn]})' if fqn in segments else ''}, "
                                f"not divisible by tp={tp} and too few to give every rank a part "
                                f"(torch.chunk's shares {chunk_sizes(size, tp)}); module {fqn.rpartition('.')[0]} "
                                f"cannot be {style}: use a tp degree in {ok}, or keep it whole with "
                                f"--plan tp={tp},tp_replicate={fqn.rpartition('.')[0]} (in a plan file: "
                                f"tp_replicate = [\"{fqn.rpartition('.')[0]}\"])")
    return d


_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")


def check_heads(program: Program, styles: dict[str, str], tp: int) -> None:
    """Attention heads must divide over the TP ranks when the plan shards attention projections; key/
    value heads may be fewer than the ranks (each rank then uses a copy of its group's KV head). Checks
    the plan's column-parallel modules whose output reaches attention in the graph, against the head
    counts of the (text) config; inferred styles are checked by the inference itself, on the graph's
    own head dims (a pair whose heads do not divide stays whole)."""
    config = getattr(program.root, "config", None)
    if config is None or tp == 1:
        return
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    planned = {m for m, st in styles.items() if st in COLWISE and m not in getattr(styles, "inferred", ())}
    attn = sorted({(n.meta.get(meta.MODULE) or "").rpartition(".")[0] for n in program.graph.nodes
                   if n.meta.get(meta.MODULE) in planned and linear_weight(n)[0] is not None and _reaches_attention(n)})
    if not attn:
        return
    glob = _layer_glob(attn[0])
    fix = (f"use a tp degree that divides it, or keep the attention whole with --plan tp={tp},tp_replicate={glob} "
           f"(in a plan file: tp_replicate = [\"{glob}\"])")
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


def _layer_glob(fqn: str) -> str:
    """``model.layers.3.self_attn`` -> ``model.layers.*.self_attn``: every layer's copy of the module."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _reaches_attention(node: torch.fx.Node, depth: int = 12) -> bool:
    """Whether ``node``'s output reaches, within ``depth`` ops, attention: SDPA or a 4-D batched matmul."""
    todo, seen = [(node, 0)], set()
    while todo:
        n, k = todo.pop()
        for u in n.users:
            if u in seen or k >= depth:
                continue
            seen.add(u)
            if packet(u) is aten.scaled_dot_product_attention or (packet(u) in (aten.matmul, aten.bmm) and
                                                                   linear_weight(u)[0] is None and node_ndim(u) >= 3):
                return True
            if linear_weight(u)[0] is None:
                todo.append((u, k + 1))
    return False

