"""What two plan options change in a model's costs, read off the same trace as the rest of
:class:`~fxpar.planner.model_costs.ModelCosts`: the expert layers (``Plan(ep=N)``) and the fused loss
(``Plan(fused_loss=True)``). Their prices are :mod:`fxpar.cost.experts` and the fused post part's own
costs; nothing is priced here.

* :func:`read_experts`: per part, the expert regions ``passes/expert_parallel.py`` would cut (found the
  same way, :func:`~fxpar.passes.expert_parallel.expert_regions`), as an :class:`~fxpar.cost.experts.Experts`.
* :class:`FusedLoss`: the program after ``passes/fused_loss.py``, whose "post" part (head and loss) is
  read at each tp degree on first use: the TP pass runs on it only for the degrees a search asks about.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fxpar.cost.experts import Experts
from fxpar.cost.partition import top_nodes
from fxpar.cost.saved import SavedTensors
from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.numeric import nbytes
from fxpar.passes.ep_loops import loop_regions
from fxpar.passes.expert_parallel import descendants, expert_regions
from fxpar.passes.fused_loss import fuse_loss
from fxpar.passes.pipeline_split import loss_position
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.zero3 import read_as_head

__all__ = ["FusedLoss", "add_variants", "read_experts"]


def read_experts(program, assign, node_rows) -> tuple[dict[str, Experts], str | None]:
    """Per part of ``program`` (``assign``: top-level node -> part) with expert layers, its
    :class:`Experts`; and None, or why ``ep > 1`` cannot be priced (no expert layers, or layers the EP
    pass refuses). ``node_rows(node)``: the rows a node adds to its part's ``nodes``."""
    try:
        regions = expert_regions(program, 1)
        loops = loop_regions(program, 1) if not regions else []
    except PlanError as e:
        return {}, str(e)
    if loops:
        return loop_experts(program, assign, loops)
    first: dict = {}  # node -> its first row in its part
    count: dict[str, int] = {}
    for node in top_nodes(program):
        part = assign[node]
        first[node] = (part, count.get(part, 0))
        count[part] = count.get(part, 0) + len(node_rows(node))
    saved = SavedTensors(program)
    found: dict[str, dict] = {}
    for r in regions:
        inner = (set(r.mms) | descendants(r.mms)) - descendants([r.exit])
        part = assign.get(r.exit)
        if part is None or any(n in first and first[n][0] != part for n in inner):
            return {}, f"the experts of {r.layer} are not inside one part of the trace"
        rows = [first[n][1] + i for n in inner if n in first for i in range(len(node_rows(n)))]
        mms = [first[m][1] for m in r.mms if m in first]
        kept = {k.key: k.nbytes for n in inner for k in saved.of(n)}
        got = found.setdefault(part, {"n": r.n_experts, "params": 0, "rows": [], "dispatch": 0, "combine": 0,
                                      "saved": 0, "layers": 0, "mms": []})
        got["n"] = math.gcd(got["n"], r.n_experts)
        got["params"] += sum(program.params[f].numel for f in set(r.params))
        got["rows"] += rows
        got["mms"] += mms
        got["dispatch"] += nbytes(r.entry.meta.get(meta.VAL)) or 0
        got["combine"] += nbytes(r.exit.meta.get(meta.VAL)) or 0
        got["saved"] += sum(kept.values())
        got["layers"] += 1
    return {part: Experts(g["n"], g["params"], tuple(sorted(g["rows"])), g["dispatch"], g["combine"], g["saved"],
                          g["layers"], tuple(sorted(g["mms"]))) for part, g in found.items()}, None


def loop_experts(program, assign, loops) -> tuple[dict[str, Experts], str | None]:
    """:func:`read_experts` of experts run as a loop over the experts (``passes/ep_loops.py``): per part, the
    bytes of the token inputs gathered, of the output scattered, of the gathered floats (their gradients go
    back) and the expert entries cut."""
    found: dict[str, dict] = {}
    for r in loops:
        part = assign.get(r.links[-1])
        if part is None:
            return {}, f"the expert loop of {r.layer} is not inside one part of the trace"
        got = found.setdefault(part, {"n": r.n_experts, "params": 0, "dispatch": 0, "combine": 0, "back": 0,
                                      "layers": 0})
        vals = [a.meta.get(meta.VAL) for a in r.gathered]
        got["n"] = math.gcd(got["n"], r.n_experts)
        got["params"] += sum(program.params[f].numel for f in r.cut)
        got["dispatch"] += sum(nbytes(v) or 0 for v in vals)
        got["back"] += sum(nbytes(v) or 0 for v in vals if v.is_floating_point())
        got["combine"] += nbytes(r.acc.meta.get(meta.VAL)) or 0
        got["layers"] += 1
    return {part: Experts(g["n"], g["params"], (), g["dispatch"], g["combine"], 0, g["layers"], (), "loop", g["back"])
            for part, g in found.items()}, None


class FusedLoss:
    """The fused loss's "post" part per ``(tp, sequence_parallel)`` (:meth:`post`), read on first use from
    the program ``passes/fused_loss.py`` makes (``fuses``: False where no loss matches its pattern)."""

    def __init__(self, program, rank_parts):
        self.program, names = fuse_loss(program)
        self.fuses = bool(names)
        self._rank_parts = rank_parts
        self._post: dict = {}
        self.head = head_on_shards(self.program) if self.fuses else None

    def post(self, tp: int, sp: bool):
        key = (tp, sp and tp > 1)
        got = self._post.get(key)
        if got is None:
            program = self.program
            if tp > 1:
                loss = loss_position(program)
                keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
                program, _ = tensor_parallel(program, tp, 0, keep_outputs=keep, sequence_parallel=key[1])
            got = self._post[key] = self._rank_parts(program)[0]["post"]
        return got


def head_on_shards(program) -> HeadOnShards | None:
    """The head ZeRO-3 leaves on its shards under the fused loss at tp=1 (``passes/zero3.py``): a 2-D parameter
    every reader of which is the fused loss, reading it as its weight (None where there is none)."""
    weights = {b.placeholder: b.target for b in program.inputs if b.kind == "parameter"}
    for node in program.graph.nodes:
        fqn = weights.get(node.name) if node.op == "placeholder" else None
        info = program.params.get(fqn) if fqn is not None else None
        if info is not None and len(info.shape) == 2 and read_as_head(node):
            return HeadOnShards(info.shape[0], info.shape[1], info.requires_grad)
    return None


@dataclass(frozen=True)
class HeadOnShards:
    """A head ZeRO-3 never gathers (``passes/zero3.py``): its ``rows`` x ``cols`` entries stay sharded by rows
    over the dp group, where ``rows`` divides by it, and the loss gathers the hidden states instead."""

    rows: int
    cols: int
    trained: bool

    def applies(self, dp: int) -> bool:
        return dp > 1 and self.rows % dp == 0


def add_variants(costs, program, parts_of: dict, traced: dict[str, str], assign, node_rows, rank_parts) -> None:
    """Fill ``costs.ep_allowed``, each tp=1 part's ``experts`` and ``costs.fused`` from ``program`` (the
    trace ``parts_of`` was read from; ``traced``: layer kind -> its traced layer)."""
    experts, why = read_experts(program, assign, node_rows)
    costs.ep_allowed = why
    fqn = {"pre": "pre", "post": "post", **traced}
    for name, part in parts_of.items():
        part.experts = experts.get(fqn.get(name, name))
    if why is None and not any(p.experts for p in parts_of.values()):
        costs.ep_allowed = "no expert layer is in the traced parts"
    fused = FusedLoss(program, rank_parts)
    costs.fused = fused if fused.fuses else None
