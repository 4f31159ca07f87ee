"""Where to cut a program into pipeline stages: candidates, the balanced choice, and the baselines.

A cut is "the beginning of module M": the position of the first top-level node owned by M (or one of
its submodules) in graph order, which is execution order. Candidates come from the model's
``base_model_pp_plan`` (its ModuleLists contribute every block) or, without one, the children of the
longest ModuleList; the children of every block are candidates too, so that stages can balance to
less than a block when a vocabulary-sized head or embedding would otherwise leave one stage heavy.

:func:`balanced_cuts` chooses the cuts that minimise the slowest stage's forward + backward time plus
its boundary transfers (activations in, gradients back) by the one cut algorithm
(:func:`fxpar.cost.stages.balanced_split`, a dynamic program) over the candidates,
every node weighted by the roofline of :mod:`fxpar.cost.roofline` on a device profile (so the LM head
counts its vocabulary-sized matmul and the memory-bound loss over the logits, the embedding its gather).
Without a profile, the published H100's in bf16 (:data:`fxpar.cost.profiles.H100`). Boundary bytes leave
out what every stage recomputes instead of receiving (masks, rotary tables:
:mod:`fxpar.cost.boundary`); :func:`stage_costs` counts exactly what the split sends.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch.fx

from fxpar.cost.boundary import recomputable, routed_bytes, value_bytes
from fxpar.cost.profiles import H100, DeviceProfile
from fxpar.cost.roofline import node_time, transfer_time
from fxpar.cost.stages import balanced_split
from fxpar.ir import meta
from fxpar.ir.analysis import grad_flow
from fxpar.ir.errors import PlanError
from fxpar.ir.program import Program, iter_nodes, subgraphs_of

_SKIP = ("placeholder", "output", "get_attr")


@dataclass(frozen=True)
class StageCost:
    first_module: str
    start: int  # top-level node positions [start, end)
    end: int
    fwd: float  # seconds per traced batch
    bwd: float
    recv_bytes: int
    send_bytes: int
    params: int
    transfer: float  # seconds: activations in and out, their gradients back
    grad_send_bytes: int = 0  # gradients sent back to earlier stages
    grad_recv_bytes: int = 0

    @property
    def total(self) -> float:
        return self.fwd + self.bwd + self.transfer


def top_nodes(program: Program) -> list[torch.fx.Node]:
    return [n for n in program.graph.nodes if n.op not in _SKIP]


def module_positions(program: Program) -> dict[str, tuple[int, int]]:
    """Module FQN -> (first, last) top-level node position it owns (its submodules' nodes included)."""
    spans: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(top_nodes(program)):
        owner = node.meta.get(meta.MODULE, "")
        parts = owner.split(".") if owner else []
        for k in range(1, len(parts) + 1):
            m = ".".join(parts[:k])
            first, _ = spans.get(m, (i, i))
            spans[m] = (first, i)
    return spans


def candidate_modules(program: Program, extra: tuple[str, ...] = ()) -> list[str]:
    """Modules at whose beginning a stage may start, in no particular order."""
    info = program.info
    root = program.root
    names: list[str] = []
    units = list((info.pp_plan or {}).keys())
    if not units and info.layer_container:
        units = [info.layer_container]
    for unit in units:
        mod = root.get_submodule(unit) if root is not None else None
        if isinstance(mod, torch.nn.ModuleList):
            for child, block in mod.named_children():
                block_fqn = f"{unit}.{child}"
                names.append(block_fqn)
                names.extend(f"{block_fqn}.{c}" for c, _ in block.named_children())
        else:
            names.append(unit)
    names.extend(extra)
    return names


def cut_positions(program: Program, modules: list[str]) -> dict[int, str]:
    """Top-level position -> module for each candidate that owns nodes (first module wins a tie)."""
    spans = module_positions(program)
    out: dict[int, str] = {}
    for m in modules:
        if m in spans and spans[m][0] > 0:
            out.setdefault(spans[m][0], m)
    return dict(sorted(out.items()))


def node_times(program: Program, profile: DeviceProfile = H100, dtype: str = "bf16") -> list[tuple[float, float]]:
    """(fwd, bwd) roofline seconds of every top-level node computing in ``dtype``, subgraphs of
    higher-order ops included."""
    times = []
    for node in top_nodes(program):
        fwd, bwd = node_time(profile, node.meta.get(meta.COST, meta.ZERO_COST), dtype)
        for sub in subgraphs_of(program.gm, node):
            for inner in iter_nodes(sub):
                f, b = node_time(profile, inner.meta.get(meta.COST, meta.ZERO_COST), dtype)
                fwd, bwd = fwd + f, bwd + b
        times.append((fwd, bwd))
    return times


def crossing_bytes(program: Program, recompute: set[torch.fx.Node] | None = None) -> tuple[list[int], list[int]]:
    """For each position c (0..N): bytes of values made before c and read at or after c, and of their
    gradients (values a gradient flows through).

    User inputs, parameters, buffers and constants are local to every stage, and values a stage
    recomputes (:func:`fxpar.cost.boundary.recomputable`) are not sent, so neither counts. When every
    value read across c is read by the next stage only, these are exactly the bytes sent at c.
    """
    recompute = recomputable(program) if recompute is None else recompute
    grad = grad_flow(program)
    nodes = top_nodes(program)
    pos = {n: i for i, n in enumerate(nodes)}
    delta, gdelta = [0] * (len(nodes) + 2), [0] * (len(nodes) + 2)
    for i, node in enumerate(nodes):
        last = max((pos[u] for u in node.users if u in pos), default=None)
        if last is None or last <= i or node in recompute:
            continue
        b = value_bytes(node.meta.get(meta.VAL))
        delta[i + 1] += b
        delta[last + 1] -= b
        if node in grad:
            gdelta[i + 1] += b
            gdelta[last + 1] -= b
    out, gout, run, grun = [], [], 0, 0
    for c in range(len(nodes) + 1):
        run, grun = run + delta[c], grun + gdelta[c]
        out.append(run)
        gout.append(grun)
    out[-1] = gout[-1] = 0  # nothing is sent after the last node
    return out, gout


def _param_counts(program: Program) -> list[int]:
    """Parameters first read at each top-level position."""
    counts = [0] * len(top_nodes(program))
    pos = {n: i for i, n in enumerate(top_nodes(program))}
    for node in program.graph.nodes:
        fqn = node.meta.get(meta.PARAM)
        if fqn and not program.params[fqn].is_buffer:
            first = min((pos[u] for u in node.users if u in pos), default=None)
            if first is not None:
                counts[first] += program.params[fqn].numel
    return counts


class _Costs:
    """Prefix sums so that any stage [a, b) costs O(1) for the dynamic program."""

    def __init__(self, program: Program, profile: DeviceProfile, dtype: str):
        self.times = node_times(program, profile, dtype)
        self.cross, self.gcross = crossing_bytes(program)
        self.profile = profile
        self.pf, self.pb, self.pp = [0.0], [0.0], [0]
        for (f, b), p in zip(self.times, _param_counts(program)):
            self.pf.append(self.pf[-1] + f)
            self.pb.append(self.pb[-1] + b)
            self.pp.append(self.pp[-1] + p)

    def total(self, a: int, b: int) -> float:
        """Forward + backward + transfer time of stage [a, b): activations in at ``a`` and out at ``b``,
        gradients of those a gradient flows through the other way."""
        p, n = self.profile, len(self.times)

        def t(nbytes):
            return transfer_time(p, nbytes)
        xfer = (t(self.cross[a]) + t(self.gcross[a]) if a else 0.0) + \
            (t(self.cross[b]) + t(self.gcross[b]) if b < n else 0.0)
        return self.pf[b] - self.pf[a] + self.pb[b] - self.pb[a] + xfer


def stage_costs(program: Program, cuts: list[tuple[str, str]], profile: DeviceProfile = H100,
                dtype: str = "bf16") -> list[StageCost]:
    """The cost of each stage for the given cuts on ``profile`` computing in ``dtype``; its bytes are the
    ones the split sends (:func:`fxpar.cost.boundary.routed_bytes`: each value once to each stage reading it)."""
    spans = module_positions(program)
    costs = _Costs(program, profile, dtype)
    bounds = [0] + [cut_position(spans, c) for c in cuts] + [len(costs.times)]
    names = [""] + [m if w == "beginning" else f"after {m}" for m, w in cuts]
    routed = routed_bytes(program, bounds)

    def t(nbytes):
        return transfer_time(profile, nbytes)
    out = []
    for i, name in enumerate(names):
        a, b = bounds[i], bounds[i + 1]
        recv, send = routed["recv"][i], routed["send"][i]
        xfer = t(recv) + t(send) + t(routed["grad_send"][i]) + t(routed["grad_recv"][i])
        out.append(StageCost(name, a, b, costs.pf[b] - costs.pf[a], costs.pb[b] - costs.pb[a], recv, send,
                             costs.pp[b] - costs.pp[a], xfer, routed["grad_send"][i], routed["grad_recv"][i]))
    return out


def balanced_cuts(program: Program, n_stages: int, profile: DeviceProfile = H100, dtype: str = "bf16",
                  extra: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """Cuts ``(module, "beginning")`` minimising the slowest stage's fwd + bwd + transfer time on
    ``profile`` computing in ``dtype``."""
    if n_stages == 1:
        return []
    cands = cut_positions(program, candidate_modules(program, extra))
    if len(cands) < n_stages - 1:
        blocks = sum(_is_block(program, m) for m in cands.values())
        raise PlanError(
            f"{n_stages} pipeline stages need {n_stages - 1} cuts, but {program.info.model_class} offers only "
            f"{len(cands)} cut points ({', '.join(list(cands.values())[:8])}{'...' if len(cands) > 8 else ''}): "
            f"at most {len(cands) + 1} stages (pp x virtual_stages); with its {blocks} decoder layers, "
            f"{blocks} stages give each one layer; use fewer stages, or name more modules to cut at in split_points")
    costs = _Costs(program, profile, dtype)
    pts = [0] + list(cands) + [len(costs.times)]

    def t(nbytes):
        return transfer_time(profile, nbytes)
    edge = [0.0] + [t(costs.cross[x]) + t(costs.gcross[x]) for x in cands] + [0.0]
    chosen = balanced_split([costs.pf[x] for x in pts], [costs.pb[x] for x in pts], edge, n_stages)
    return [(cands[pts[j]], "beginning") for j in chosen]


def cut_position(spans: dict[str, tuple[int, int]], cut: tuple[str, str]) -> int:
    """Top-level position where the stage after ``cut = (module, "beginning" | "end")`` starts."""
    fqn, where = cut
    if fqn not in spans:
        near = sorted(m for m in spans if m.startswith(fqn.rpartition(".")[0]))[:8]
        raise PlanError(f"split point {fqn!r} owns no node of the traced graph; modules near it: {near}")
    return spans[fqn][0] if where == "beginning" else spans[fqn][1] + 1


def resolve_split_points(program: Program, split_points: dict[str, str]) -> list[tuple[str, str]]:
    """Explicit ``{"model.layers.16": "beginning" | "end"}`` -> cuts in graph order."""
    spans = module_positions(program)
    n = len(top_nodes(program))
    cuts = sorted(split_points.items(), key=lambda c: cut_position(spans, c))
    positions = [cut_position(spans, c) for c in cuts]
    for c, pos in zip(cuts, positions):
        if pos <= 0 or pos >= n:
            raise PlanError(f"split point {c[0]!r} ({c[1]}) would leave an empty first or last stage")
    if len(set(positions)) != len(positions):
        raise PlanError(f"split points {dict(cuts)} cut at the same place twice; drop one")
    return cuts


# ---- baselines, for comparison in reports and benchmarks ------------------------------------------------
def even_layer_cuts(program: Program, n_stages: int) -> list[tuple[str, str]]:
    """torchtitan's manual split: the blocks divided evenly, embedding on the first stage, head on the last."""
    blocks = [m for m in candidate_modules(program) if _is_block(program, m)]
    per = len(blocks) / n_stages
    return [(blocks[round(i * per)], "beginning") for i in range(1, n_stages)]


def param_count_cuts(program: Program, n_stages: int) -> list[tuple[str, str]]:
    """PiPPy's old balancing: equal parameter counts per stage, cutting at block boundaries."""
    spans = module_positions(program)
    blocks = [m for m in candidate_modules(program) if _is_block(program, m) or m not in _children(program)]
    cands = sorted({spans[m][0]: m for m in blocks if m in spans and spans[m][0] > 0}.items())
    counts = _param_counts(program)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    total = prefix[-1]
    cuts = []
    for s in range(1, n_stages):
        target = total * s / n_stages
        idx = bisect.bisect_left([prefix[p] for p, _ in cands], target)
        idx = min(max(idx, len(cuts)), len(cands) - (n_stages - s))
        cuts.append((cands[idx][1], "beginning"))
    return cuts


def _is_block(program: Program, fqn: str) -> bool:
    parent, _, last = fqn.rpartition(".")
    return last.isdigit() and isinstance(program.root.get_submodule(parent), torch.nn.ModuleList)


def _children(program: Program) -> set[str]:
    """Candidates that are children of blocks (finer than a block)."""
    out = set()
    for m in candidate_modules(program):
        parent = m.rpartition(".")[0]
        if parent and parent.rpartition(".")[2].isdigit():
            out.add(m)
    return out


def balance(costs: list[StageCost]) -> float:
    """max / mean of stage totals (1.0 is perfect)."""
    totals = [c.total for c in costs]
    return max(totals) / (sum(totals) / len(totals))
