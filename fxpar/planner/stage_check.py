"""Pipelines worth their ranks: a warning, once per compile, when a plan's cuts leave stages nearly empty or
its schedule idles most of the step, with the numbers and a better plan.

Reads the traced program (its cut candidates, decoder layers, node costs and parameters), the cuts
``fxpar.compile`` chose (:func:`fxpar.cost.partition.balanced_cuts` or the plan's ``split_points``), the
plan, its :class:`~fxpar.planner.feasibility.PipelineSetup` and the device profile (and dtype) the cuts were
balanced on.
Writes nothing: :func:`pipeline_warning` returns the text (None when the pipeline is sound) and
:func:`warn_pipeline` logs it on the ``fxpar`` logger, which ``fxpar plan`` and ``fxpar train`` print.

The bubble is the share of the step a rank idles when the stages take their compute times under the
plan's schedule (:func:`fxpar.cost.schedule.makespan`, transfers left out: they are a property of the
device's links, not of the cuts or the microbatch count). Times scale with the microbatch size alike on
every stage, so the bubble of another microbatch count is simulated with the same per-stage times.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from fxpar.cost.partition import candidate_modules, cut_positions, module_positions, stage_costs, top_nodes
from fxpar.cost.profiles import DeviceProfile
from fxpar.cost.schedule import makespan
from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program, iter_nodes, subgraphs_of
from fxpar.ir.schedule import build_schedule

EMPTY_SHARE = 0.1  # a stage with under this share of the busiest stage's FLOPs is nearly empty
# a schedule idling more of the step than this warns: above what the default microbatch count (one per
# stage: a bubble of (p - 1) / (2p - 1) < 50% under 1F1B) gives with stages about even
BUBBLE_LIMIT = 0.6
BUBBLE_GOAL = 0.25  # the bubble a suggested microbatch count brings the schedule under

log = logging.getLogger("fxpar")


@dataclass(frozen=True)
class StageLoad:
    """What one stage computes per microbatch: decoder layers whole in it and cut through, parameters,
    forward + backward FLOPs and seconds (on the device profile), the modules it starts and ends with."""
    index: int
    layers: int
    partial: int
    params: int
    flops: int
    fwd: float
    bwd: float
    span: str

    @property
    def seconds(self) -> float:
        return self.fwd + self.bwd


def _flops(program: Program, nodes) -> int:
    total = 0
    for node in nodes:
        for n in (node, *(i for sub in subgraphs_of(program.gm, node) for i in iter_nodes(sub))):
            cost = n.meta.get(meta.COST, meta.ZERO_COST)
            total += cost.flops + cost.bwd_flops
    return total


def decoder_layers(program: Program) -> list[str]:
    """The FQNs of the model's repeated blocks (the children of its layer container) that the graph runs,
    in graph order."""
    container = program.info.layer_container
    if program.root is None or not container:
        return []
    spans = module_positions(program)
    blocks = [f"{container}.{c}" for c, _ in program.root.get_submodule(container).named_children()]
    return sorted((b for b in blocks if b in spans), key=lambda b: spans[b][0])


def stage_loads(program: Program, cuts: list[tuple[str, str]], profile: DeviceProfile,
                dtype: str = "fp32") -> list[StageLoad]:
    """One :class:`StageLoad` per stage of ``cuts``, timed on ``profile`` computing in ``dtype``."""
    spans = module_positions(program)
    nodes = top_nodes(program)
    units = cut_positions(program, candidate_modules(program))
    blocks = [spans[b] for b in decoder_layers(program)]
    out = []
    for i, cost in enumerate(stage_costs(program, cuts, profile, dtype)):
        a, b = cost.start, cost.end
        whole = sum(a <= lo and hi < b for lo, hi in blocks)
        partial = sum(lo < b and hi >= a for lo, hi in blocks) - whole
        starts = [m for pos, m in units.items() if a <= pos < b]
        first = cost.first_module or "(start)"
        span = first if not starts or starts[-1] == first else f"{first} .. {starts[-1]}"
        out.append(StageLoad(i, whole, partial, cost.params, _flops(program, nodes[a:b]), cost.fwd, cost.bwd,
                             span))
    return out


def _bubble(schedule: str, pp: int, m: int, n_stages: int, stage_to_rank, loads: list[StageLoad]) -> float:
    """The share of the step a rank idles: the schedule's critical path on the stages' compute times."""
    f, b = [x.fwd for x in loads], [x.bwd for x in loads]
    actions = build_schedule(schedule, pp, m, n_stages)  # split backwards: input and weight halves, as predicted
    return makespan(actions, list(stage_to_rank), f, b, [x / 2 for x in b])[1]


def pipeline_warning(program: Program, cuts: list[tuple[str, str]], plan: Plan, setup,
                     profile: DeviceProfile, dtype: str = "fp32") -> str | None:
    """The warning for a pipeline whose stages are nearly empty (under :data:`EMPTY_SHARE` of the busiest
    stage's forward + backward FLOPs) or whose bubble exceeds :data:`BUBBLE_LIMIT`: the numbers per stage and a
    better plan. None for a sound pipeline (or none at all)."""
    if setup.n_stages < 2:
        return None
    loads = stage_loads(program, cuts, profile, dtype)
    busiest = max(x.flops for x in loads)  # FLOPs, not seconds: tiny stages are bound by memory on any device
    empty = [x for x in loads if x.flops < EMPTY_SHARE * busiest]
    bubble = _bubble(setup.schedule, plan.pp, setup.microbatches, setup.n_stages, setup.stage_to_rank, loads)
    if not empty and bubble <= BUBBLE_LIMIT:
        return None
    layers = decoder_layers(program)
    head = (f"pipeline pp={plan.pp} ({setup.n_stages} stages, {setup.schedule}, "
            f"{setup.microbatches} microbatch{'es' if setup.microbatches != 1 else ''}) "
            f"on {program.info.model_class} with {len(layers)} decoder layers: ")
    problems = []
    if empty:
        problems.append(f"{len(empty)} of {setup.n_stages} stages are nearly empty (under {EMPTY_SHARE:.0%} of "
                        f"the busiest stage's FLOPs: stages {', '.join(str(x.index) for x in empty)})")
    mean = sum(x.seconds for x in loads) / len(loads)
    problems.append(f"the schedule idles {bubble:.1%} of the step (the bubble, from the stages' compute"
                    f"{'; above ' + format(BUBBLE_LIMIT, '.0%') if bubble > BUBBLE_LIMIT else ''}; slowest stage "
                    f"/ mean {max(x.seconds for x in loads) / mean:.2f})")
    rows = [("stage", "layers", "params", "fwd+bwd FLOPs", "modules")]
    for x in loads:
        rows.append((str(x.index), f"{x.layers}" + (f" (+{x.partial} cut)" if x.partial else ""), _num(x.params),
                     _num(x.flops), x.span))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    table = ["  " + "  ".join(r[c].rjust(widths[c]) for c in range(4)) + "  " + r[4] for r in rows]
    better = _better(plan, setup, len(layers), loads, bubble, empty)
    return head + " and ".join(problems) + ".\n" + "\n".join(table) + ("\n" + better if better else "")


def _better(plan: Plan, setup, n_layers: int, loads, bubble: float, empty) -> str:
    """A better plan on the same ranks: the largest pp that gives each stage at least one decoder layer
    (dp taking the ranks pp gives up), and a microbatch count that brings the bubble under :data:`BUBBLE_GOAL`."""
    out = []
    per_rank = setup.n_stages // plan.pp
    if empty and n_layers:
        fits = [p for p in range(plan.pp - 1, 0, -1) if p * per_rank <= n_layers and (plan.dp * plan.pp) % p == 0]
        if fits:
            p = fits[0]
            dp = plan.dp * plan.pp // p
            degrees = ",".join(f"{k}={v}" for k, v in (("dp", dp), ("pp", p), ("tp", plan.tp)) if v > 1 or k == "pp")
            out.append(f"use pp={p} (each of its {p * per_rank} stages at least one of the {n_layers} decoder layers), "
                       f"e.g. --plan {degrees} on the same {plan.world_size} ranks")
    if bubble > BUBBLE_LIMIT and not empty:  # the fill and drain: more microbatches (equal stages: the schedule's own)
        even = [dataclasses.replace(x, fwd=1.0, bwd=2.0) for x in loads]
        per_replica, good = setup.batch // setup.dp, []
        for m in sorted({k * plan.pp for k in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)} - set(range(setup.microbatches + 1))):
            try:
                if _bubble(setup.schedule, plan.pp, m, setup.n_stages, setup.stage_to_rank, even) <= BUBBLE_GOAL:
                    good.append(m)
            except PlanError:  # a count this schedule cannot run (e.g. not a multiple of pp)
                continue
        if good:
            m = next((k for k in good if per_replica % k == 0), good[0])
            got = _bubble(setup.schedule, plan.pp, m, setup.n_stages, setup.stage_to_rank, loads)
            batch = "" if per_replica % m == 0 else \
                f" with a global batch that is a multiple of {m * setup.dp} (now {setup.batch})"
            out.append(f"use more microbatches: microbatches={m} idles {got:.1%} of the step{batch}")
    return ("better: " + "; or ".join(out)) if out else ""


def warn_pipeline(program: Program, cuts: list[tuple[str, str]], plan: Plan, setup, profile: DeviceProfile,
                  dtype: str = "fp32") -> None:
    """Log :func:`pipeline_warning`'s text on the ``fxpar`` logger, if any."""
    text = pipeline_warning(program, cuts, plan, setup, profile, dtype)
    if text:
        log.warning("fxpar: warning: " + text)


def _num(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"

