"""A model's costs for the planner, from one trace: per part (what runs before the first layer, each kind of
layer, what runs after the last) and per tensor-parallel degree, what one rank computes, holds and
communicates for one sequence. Repeated layers are priced once.

:func:`model_costs` traces a shortened copy of the model (:mod:`fxpar.planner.shorten`: one layer of
each kind, on the meta device; batch 1 of ``seq`` tokens with labels, so the loss is in), runs the
tensor-parallel pass on the trace for each degree (with and without sequence parallelism) exactly as
``fxpar.compile`` would, and reads each part off the rewritten graph: per node its FLOPs and bytes
(:mod:`fxpar.cost.flops`, on this rank's shapes), the parameters this rank holds, the TP collectives
(:mod:`fxpar.cost.comm`), the activations kept for backward per recompute policy
(:func:`fxpar.cost.activations.part_activations`, masks and rotary tables counted once) and
the bytes a pipeline cut after the part sends.

Nodes belong to the decoder layer that owns their module (``fxpar.cost.activations.layer_of``); nodes outside
the layers are "pre" before the first layer and "post" after the last; a node outside every layer that
runs between two layers goes with the layer before it. Where the traced layers of one kind do not cost
the same, or the model has no layer count, the whole model is traced instead (slower, still correct).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.fx

from fxpar.cost.activations import layer_of, part_activations
from fxpar.cost.comm import payloads
from fxpar.cost.partition import candidate_modules, crossing_bytes, cut_positions, top_nodes
from fxpar.cost.predict import backward_grads, kept_outputs
from fxpar.cost.roofline import work_time
from fxpar.frontend.hf import longest_module_list
from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.numeric import nbytes
from fxpar.ir.ops import collective_kind, collective_nodes
from fxpar.ir.placement import Partial
from fxpar.ir.program import Program, iter_nodes, subgraphs_of
from fxpar.passes.pipeline_split import loss_position
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.planner.cp_costs import read_attention
from fxpar.planner.shorten import (
    Shortened,
    full_copy,
    kind_names,
    per_layer_lists,
    shorten,
    text_config,
    trace_copy,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class RankPart:
    """What one tp rank does for one part, for one sequence (batch 1) of ``seq`` tokens."""

    nodes: list[tuple[float, ...]]  # per node: (fwd_flops, bwd_flops, act_bytes, weight_bytes[, out_bytes])
    params: int  # parameter entries this tp rank holds for the part
    comm: list[tuple[str, int, str]] = field(default_factory=list)  # (kind, full payload bytes per sequence, fwd|bwd)
    act: dict[str, tuple[int, int]] = field(default_factory=dict)  # recompute policy -> (kept, transient) bytes
    out_bytes: int = 0  # activation bytes a pipeline cut after this part sends per sequence
    grad_bytes: int = 0  # backward's transient: most gradient bytes alive at once in the part's backward, per sequence
    kept_out: int = 0  # the program's outputs the part makes (logits), per sequence: kept to the end of the step
    # where compile may cut inside the part (tp=1): per segment, (its first row in ``nodes``, bytes crossing
    # its start and their gradients' per sequence, the candidate module a stage may begin at or None; in a
    # layer with "{}" for the layer's index, "model.layers.{}.mlp"); empty: unknown
    units: list[tuple[int, int, int, str | None]] = field(default_factory=list)
    experts: object = None  # its expert layers (fxpar.cost.experts.Experts, tp=1 parts; None: none)
    attention: object = None  # what context parallelism gathers (fxpar.cost.context_parallel.Attention; None: none)
    # parameters it reads that ``params`` counts in another part: name -> (that part, entries on this tp rank).
    # Only the weights "pre" and "post" share (a tied embedding and head): a pipeline stage running "post"
    # without "pre" holds its own copy, its gradient and optimizer state (runtime/tied.py)
    borrowed: dict[str, tuple[str, int]] = field(default_factory=dict)
    frozen: int = 0  # of ``params``, entries that do not train (requires_grad=False: a LoRA's base): weights only
    _times: dict = field(default_factory=dict, repr=False, compare=False)  # (profile id, batch, dtype) -> result

    def largest_weight(self) -> int:
        """Bytes of the largest weight one op of the part reads (the embedding, a projection): what the
        optimizer's per-tensor temporaries are sized by."""
        got = self._times.get("largest_weight")  # (the search asks for it per stage of every plan)
        if got is None:
            got = self._times["largest_weight"] = max((int(n[3]) for n in self.nodes), default=0)
        return got

    def time(self, profile, batch: int, dtype: str) -> tuple[float, float]:
        """(forward, backward) seconds for a microbatch of ``batch`` sequences on ``profile``: each node's
        :func:`fxpar.cost.roofline.work_time` (activation bytes scale with the batch, weight bytes do not).
        Cached per profile, batch and dtype."""
        key = (id(profile), batch, dtype)
        hit = self._times.get(key)
        if hit is not None and hit[0] is profile:
            return hit[1]
        fwd = bwd = 0.0
        for f, b, act, weight, *out in self.nodes:
            tf, tb = work_time(profile, f * batch, b * batch, act * batch + weight, out[0] * batch if out else 0.0,
                               dtype)
            fwd, bwd = fwd + tf, bwd + tb
        self._times[key] = (profile, (fwd, bwd))
        return fwd, bwd

    @property
    def flops(self) -> tuple[float, float]:
        """(forward, backward) FLOPs for one sequence."""
        return sum(n[0] for n in self.nodes), sum(n[1] for n in self.nodes)


@dataclass
class ModelCosts:
    seq: int
    dtype: str  # "fp32" or "bf16": how the step computes
    layers: list[str]  # kind of each of the model's layers, in order
    parts: dict[str, dict[tuple[int, bool], RankPart]]  # "pre", layer kinds, "post" -> (tp, sp) -> RankPart
    params: int  # the whole model's parameter entries
    tp_allowed: dict[int, str | None]  # tp degree -> None if usable, else the reason
    flops_per_token: float  # fwd + bwd model FLOPs per token (no recompute), for MFU
    traced_layers: int
    sp_allowed: dict[int, str | None] = field(default_factory=dict)  # tp degree -> None if sequence parallel works
    ep_allowed: str | None = "not read"  # None if Plan(ep > 1) can be priced, else why not
    fused: object = None  # the fused loss's post part per tp (fxpar.planner.variants.FusedLoss); None: does not fuse

    def part(self, name: str, tp: int, sp: bool = False) -> RankPart:
        """Part ``name`` ("pre", a layer kind, "post") at tp degree ``tp``, sequence parallel or not; a
        PlanError naming the reason where that degree was refused or not priced."""
        got = self.parts[name].get((tp, sp))
        if got is None:
            why = (self.sp_allowed if sp else self.tp_allowed).get(tp) or \
                f"not priced (tp degrees priced: {sorted(self.tp_allowed)})"
            raise PlanError(f"fxpar.planner.model_costs: tp={tp}{' with sequence parallel' if sp else ''}: {why}")
        return got

    def kinds(self) -> dict[str, int]:
        """Each layer kind and how many of the model's layers are of it, in order of first appearance."""
        out: dict[str, int] = {}
        for k in self.layers:
            out[k] = out.get(k, 0) + 1
        return out


def _dtype_key(model: torch.nn.Module) -> str:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    names = {v: k for k, v in DTYPES.items()}
    return names.get(p.dtype, "fp32") if p is not None else "fp32"


# ---- reading one program into parts -----------------------------------------------------------------

def _assign(program: Program) -> tuple[dict[torch.fx.Node, str], dict[torch.fx.Node, str], list[str]]:
    """Top-level node -> part ("pre", a layer FQN, "post") by where it stands, the same by what it does
    (a TP collective that reduces partial sums goes with the part where they begin: the embedding's
    all-reduce, placed at its first reader in layer 0, is the embedding's), and the traced layers in order."""
    nodes = top_nodes(program)
    layers = [layer_of(program, n.meta.get(meta.MODULE, "") or "") if n.op == "call_function" else None
              for n in nodes]
    order = list(dict.fromkeys(x for x in layers if x))
    last = max((i for i, x in enumerate(layers) if x), default=-1)
    where, current = {}, "pre"
    for i, (node, layer) in enumerate(zip(nodes, layers)):
        if layer:
            current = layer
        where[node] = layer or ("post" if i > last else current)
    what = dict(where)
    for node in nodes:
        src = node.args[0] if node.args else None
        if collective_kind(node) is not None and isinstance(src, torch.fx.Node) and _partial(src):
            what[node] = where.get(_partial_origin(src), what[node])
    return where, what, order


def _partial(node: torch.fx.Node) -> bool:
    return any(isinstance(p, Partial) for p in node.meta.get(meta.PLACEMENT, ()))


def _partial_origin(node: torch.fx.Node) -> torch.fx.Node:
    """The node where the partial sums ``node`` holds begin (a collective reduces them; the ops between,
    such as a dtype cast of the next layer's norm, carry them along)."""
    while _partial(node):
        up = next((a for a in node.all_input_nodes if a.op == "call_function" and _partial(a)), None)
        if up is None:
            break
        node = up
    return node


def _node_rows(program: Program, node: torch.fx.Node, weights: set[torch.fx.Node]) -> list[tuple]:
    rows = []
    if node.op == "call_function":
        c = node.meta.get(meta.COST, meta.ZERO_COST)
        w = sum(nbytes(a.meta.get(meta.VAL)) or 0 for a in node.all_input_nodes if a in weights)
        w = min(w, c.bytes_read)
        rows.append((float(c.flops), float(c.bwd_flops), float(c.bytes_read + c.bytes_written - w), float(w),
                     float(c.bytes_written)))
    for sub in subgraphs_of(program.gm, node):
        for inner in iter_nodes(sub):
            if inner.op == "call_function":
                c = inner.meta.get(meta.COST, meta.ZERO_COST)
                rows.append((float(c.flops), float(c.bwd_flops), float(c.bytes_read + c.bytes_written), 0.0,
                             float(c.bytes_written)))
    return rows


def _rank_parts(program: Program, units: bool = False) -> tuple[dict[str, RankPart], list[str]]:
    """One RankPart per part of ``program`` (keys: "pre", each traced layer's FQN, "post"); ``units``: with
    the segments compile's cut candidates (:func:`fxpar.cost.partition.candidate_modules`) make of it."""
    where, assign, order = _assign(program)
    cands = cut_positions(program, candidate_modules(program)) if units else {}
    cross, gcross = crossing_bytes(program)
    segs: dict[str, list] = {k: [] for k in names_of(order)}
    names = names_of(order)
    bound = {b.placeholder: b for b in program.inputs}
    weights = {n for n in program.graph.nodes if (n.op == "placeholder" and n.name in bound and
                                                  bound[n.name].kind in ("parameter", "buffer", "constant"))
               or n.op == "get_attr"}
    rows: dict[str, list] = {k: [] for k in names}
    members: dict[str, set[str]] = {k: set() for k in names}
    end: dict[str, int] = {}
    first: dict[torch.fx.Node, tuple[str, int]] = {}  # node -> (its part, its first row there)
    prev = None
    for i, node in enumerate(top_nodes(program)):
        part = assign[node]
        if units and (part != prev or i in cands):  # a segment begins: at a part's start or a candidate
            segs[part].append((len(rows[part]), cross[i], gcross[i], _relative(cands.get(i), part)))
        prev = part
        first[node] = (part, len(rows[part]))
        rows[part].extend(_node_rows(program, node, weights))
        members[part].add(node.name)
        end[where[node]] = i + 1  # a pipeline cut after the part: where its last node stands
    params, frozen = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    borrowed: dict[str, dict[str, tuple[str, int]]] = {k: {} for k in names}
    for node in program.graph.nodes:
        b = bound.get(node.name) if node.op == "placeholder" else None
        if b is None or b.kind != "parameter":
            continue
        users = [assign[u] for u in node.users if u in assign]
        owner = users[0] if users else "pre"
        numel = program.params[b.target].numel
        params[owner] += numel
        frozen[owner] += 0 if program.params[b.target].requires_grad else numel
        for other in dict.fromkeys(users):
            if other != owner and {owner, other} == {"pre", "post"}:
                borrowed[other][b.target] = (owner, numel)
    comm: dict[str, list] = {k: [] for k in names}
    for kind, node in collective_nodes(program.graph):
        part = assign.get(node, "post")
        for direction, backward in (("fwd", False), ("bwd", True)):
            comm[part].extend((c, int(nb), direction) for c, nb in payloads(kind, node, backward=backward))
    acts = part_activations(program, top_nodes(program), assign, names)
    grads, outs = backward_grads(program, assign), kept_outputs(program, assign)
    attention = read_attention(program, assign, first)
    parts = {}
    for k in names:
        out = 0 if k == "post" else cross[end.get(k, 0)]
        parts[k] = RankPart(rows[k], params[k], comm[k], acts[k], out, grads.get(k, 0), outs.get(k, 0), segs[k],
                            borrowed=borrowed[k], attention=attention.get(k), frozen=frozen[k])
    return parts, order


def _relative(module: str | None, part: str) -> str | None:
    """``module`` with the index of the layer ``part`` it is in (or is) as "{}"."""
    if module is None or part in ("pre", "post") or not (module == part or module.startswith(part + ".")):
        return module
    container, _, _ = part.rpartition(".")
    return f"{container}.{{}}{module[len(part):]}"


def names_of(order: list[str]) -> list[str]:
    return ["pre", *order, "post"]


def _alike(a: RankPart, b: RankPart) -> bool:
    fa, fb = a.flops, b.flops
    close = all(abs(x - y) <= 1e-6 * max(abs(x), abs(y), 1.0) for x, y in zip(fa + (a.params,), fb + (b.params,)))
    return close and len(a.nodes) == len(b.nodes)


# ---- the entry point --------------------------------------------------------------------------------

def model_costs(model: torch.nn.Module, seq: int, *, tp_degrees=(1, 2, 4, 8), sequence_parallel=(False, True),
                dtype: str | None = None, frontend: str = "auto", max_layers: int | None = None) -> ModelCosts:
    """The costs of ``model`` for sequences of ``seq`` tokens (see the module docstring).

    ``dtype``: "fp32", "bf16" or "fp16", how the step computes (the shortened copy is traced in it);
    None: the model's parameter dtype. ``max_layers``: the most layers the trace may have (a bound on its
    time); a PlanError where the shortened copy, or the whole model where nothing shortens it, has more.
    """
    dtype = dtype or _dtype_key(model)
    if dtype not in DTYPES:
        raise PlanError(f"fxpar.planner.model_costs: dtype={dtype!r}; use one of {sorted(DTYPES)}")
    short = shorten(model)
    parts_of, kinds, traced, n_traced, program = _trace_parts(model, short, seq, dtype, frontend, max_layers)
    costs: dict[str, dict[tuple[int, bool], RankPart]] = {}

    def add(variant: tuple[int, bool], by_part: dict[str, RankPart]) -> None:
        for name, rp in by_part.items():
            costs.setdefault(name, {})[variant] = rp

    add((1, False), parts_of)
    if True in sequence_parallel:
        add((1, True), parts_of)
    tp_allowed: dict[int, str | None] = {1: None}
    sp_allowed: dict[int, str | None] = {1: None}
    loss = loss_position(program)
    keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
    for tp in sorted(set(tp_degrees) - {1}):
        for sp in sorted(set(sequence_parallel)):
            if not sp and tp_allowed.get(tp):
                continue
            if sp and tp_allowed.get(tp):
                sp_allowed[tp] = tp_allowed[tp]
                continue
            try:
                local, _ = tensor_parallel(program, tp, 0, keep_outputs=keep, sequence_parallel=sp)
            except Exception as e:  # the pass's own checks (heads, divisibility) say why
                reason = str(e) if isinstance(e, PlanError) else f"the TP pass fails: {type(e).__name__}: {e}"
                (sp_allowed if sp else tp_allowed)[tp] = reason
                continue
            (sp_allowed if sp else tp_allowed)[tp] = None
            add((tp, sp), _by_kind(_rank_parts(local)[0], kinds, traced))
    fwd_bwd = sum(sum(costs[k][(1, False)].flops) for k in ("pre", "post")) + \
        sum(sum(costs[k][(1, False)].flops) for k in kinds)
    params = sum(p.numel() for p in model.parameters())
    out = ModelCosts(seq, dtype, kinds, costs, params, tp_allowed, fwd_bwd / seq, n_traced, sp_allowed)
    from fxpar.planner.variants import add_variants  # (it reads parts as this module does)
    add_variants(out, program, parts_of, traced, _assign(program)[1], lambda n: _node_rows(program, n, set()),
                 _rank_parts)
    return out


def _by_kind(parts: dict[str, RankPart], kinds: list[str], traced: dict[str, str]) -> dict[str, RankPart]:
    """Parts keyed by "pre", each layer kind (from its traced layer ``traced[kind]``), "post"."""
    return {"pre": parts["pre"], **{k: parts[traced[k]] for k in dict.fromkeys(kinds)}, "post": parts["post"]}


def _trace_parts(model, short: Shortened | None, seq: int, dtype: str, frontend: str, max_layers: int | None):
    """Trace the shortened copy (or the whole model) and price its tp=1 parts: (parts by kind, each of
    the model's layers' kind, kind -> traced layer FQN, the number of traced layers, the traced program)."""
    if short is not None and short.model is not None:
        _check_max(max_layers, len(short.kept), "the shortened copy")
        program = trace_copy(short.model.to(DTYPES[dtype]), seq, frontend)
        parts, order = _rank_parts(program, units=True)
        if len(order) == len(short.kept):
            by_kind: dict[str, str] = {}
            ok = True
            for fqn, i in zip(order, short.kept):
                kind = short.kinds[i]
                ok = ok and (kind not in by_kind or _alike(parts[by_kind[kind]], parts[fqn]))
                by_kind.setdefault(kind, fqn)
            if ok:
                return _by_kind(parts, short.kinds, by_kind), short.kinds, by_kind, len(order), program
        warnings.warn("fxpar.planner.model_costs: the shortened copy's layers of one kind do not cost the same "
                      "(or its layers were not found in the trace); tracing the whole model instead", stacklevel=3)
    _check_max(max_layers, len(short.kinds) if short is not None else longest_module_list(model)[1], "the whole model")
    full = full_copy(model)
    if full is not model:
        full = full.to(DTYPES[dtype])
    program = trace_copy(full, seq, frontend)
    parts, order = _rank_parts(program, units=True)
    # a layer's kind: what the config and module tree say (where they say it), told apart by its cost too
    said = short.kinds if short is not None and len(short.kinds) == len(order) else [""] * len(order)
    sigs = [(k, p.flops, p.params, len(p.nodes)) for k, p in zip(said, (parts[f] for f in order))]
    config = text_config(model)
    kinds = kind_names(sigs, per_layer_lists(config, len(order)) if config is not None else {})
    if len(set(kinds)) == len(set(said)):
        kinds = said if said[0] else kinds
    by_kind = {}
    for fqn, kind in zip(order, kinds):
        by_kind.setdefault(kind, fqn)
    return _by_kind(parts, kinds, by_kind), kinds, by_kind, len(order), program


def _check_max(max_layers: int | None, n: int, what: str) -> None:
    if max_layers is not None and n > max_layers:
        raise PlanError(f"fxpar.planner.model_costs: {what} has {n} layers to trace, more than "
                        f"max_layers={max_layers}; raise max_layers to at least {n}")
