"""Predictions for a split program: per-stage times and bytes (the step's price is fxpar.cost.estimate's),
and the activations a rank holds for backward under each recompute policy (the rule:
:mod:`fxpar.cost.activations`; the memory it holds for parameters, gradients and optimizer states:
:func:`fxpar.cost.memory.state_bytes`).

Pure functions of the program, the plan and a device profile; the compile wiring calls them, and so can
a planner pricing plans it never builds.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.cost.activations import RECOMPUTE, stage_activations
from fxpar.cost.partition import candidate_modules, cut_positions, stage_costs
from fxpar.cost.profiles import DeviceProfile
from fxpar.cost.saved import SavedTensors
from fxpar.cost.schedule import walk
from fxpar.ir import meta
from fxpar.ir.analysis import grad_flow
from fxpar.ir.program import Program
from fxpar.ir.schedule import Action
from fxpar.ir.stage import PipelineProgram


def annotate_stages(traced, pipeline: PipelineProgram, cuts, profile: DeviceProfile, dtype: str = "fp32") -> dict:
    """Fill each stage's predicted times and boundary bytes (``profile`` computing in ``dtype``); returns the
    profile's name. The step's price (its time, bubble, memory) is the plan's :class:`~fxpar.cost.estimate.Estimate`
    (``compiled.predicted``), not a sum of these stage times."""
    units = cut_positions(traced, candidate_modules(traced))
    for spec, cost in zip(pipeline.stages, stage_costs(traced, cuts, profile, dtype)):
        spec.fwd_time, spec.bwd_time, spec.transfer_time = cost.fwd, cost.bwd, cost.transfer
        spec.modules = [m for pos, m in units.items() if cost.start <= pos < cost.end]
        spec.recv_bytes, spec.send_bytes = cost.recv_bytes, cost.send_bytes
    return {"device": profile.name}


def peak_activations(per_stage: dict[int, tuple[int, int]], actions: list[Action]) -> int:
    """The most activation bytes a rank holds while it runs ``actions`` (its schedule, in order), given
    each of its stages' ``(kept, transient)`` per microbatch, at the moments of
    :func:`fxpar.cost.schedule.walk`: the kept bytes of the microbatches alive, and a backward's transient."""
    stages = sorted({a.stage for a in actions})
    costs = [per_stage.get(s, (0, 0)) for s in stages]
    return max(sum(c * k[0] for c, k in zip(live, costs)) + (costs[t][1] if t >= 0 else 0)
               for live, t, _, _ in walk(actions, stages))


def activation_memory(program: Program, stage_nodes: dict[int, set[str]] | None = None,
                      actions: list[Action] | None = None) -> dict[str, dict]:
    """Predicted activation memory of one rank, per recompute policy (:data:`RECOMPUTE`):
    ``{policy: {"per_microbatch": {stage: bytes kept}, "transient": {stage: bytes}, "peak": bytes}}``.

    ``stage_nodes``: the names of the program's nodes on each stage this rank runs (None: one stage, the
    whole program); ``actions``: this rank's schedule (None: one forward and one backward)."""
    stage_nodes = stage_nodes if stage_nodes is not None else {0: None}
    actions = actions if actions is not None else [Action("F", s, 0) for s in stage_nodes] + \
        [Action("B", s, 0) for s in reversed(list(stage_nodes))]
    per_stage = {s: stage_activations(program, names) for s, names in stage_nodes.items()}
    out = {}
    for policy in RECOMPUTE:
        costs = {s: acts[policy] for s, acts in per_stage.items()}
        out[policy] = {"per_microbatch": {s: c[0] for s, c in costs.items()},
                       "transient": {s: c[1] for s, c in costs.items()},
                       "peak": peak_activations(costs, actions)}
    return out


def backward_grads(program: Program, part_of: dict) -> dict[str, int]:
    """Per part (``part_of``: top-level node -> part name), the most gradient bytes alive at once during
    the backward of one of its nodes, beyond what that backward has already freed of the part's saved
    tensors: one batch of the program's shapes.

    Autograd holds the gradient of a value (named by storage, so a view's gradient counts with its
    base's) from the backward of its last reader to the backward of its producer; at a node's backward
    the gradients of its output and of its inputs live at once, plus, for an op that keeps a buffer of
    its own (the log-softmax a cross-entropy keeps), that buffer's gradient. The saved tensors of the
    part's nodes after the node are free by then. Parameters' gradients are state, not counted here.
    The largest is usually at the loss: the logits' gradient and the log-softmax's, one vocabulary-sized
    tensor each, on top of everything the forward kept."""
    saved = SavedTensors(program)
    flows = grad_flow(program)
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    pos = {n: i for i, n in enumerate(nodes)}
    span: dict[object, list[int]] = {}  # storage -> [producer position, last reader position, bytes]
    for n in nodes:
        val = n.meta.get(meta.VAL)
        if n not in flows or not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        for kept in saved.value(n):
            last = max((pos[u] for u in n.users if u in pos), default=pos[n])
            got = span.setdefault(kept.key, [pos[n], last, kept.nbytes])
            got[0], got[1] = min(got[0], pos[n]), max(got[1], last)
    live = [0] * (len(nodes) + 1)
    for first, last, b in span.values():
        live[first] += b
        live[last + 1] -= b
    for i in range(1, len(live)):
        live[i] += live[i - 1]
    first_saver: dict[object, tuple[int, int]] = {}  # saved storage -> (earliest saver position, bytes)
    own: list[int] = [0] * len(nodes)
    for n in nodes:
        for kept in saved.of(n):
            if isinstance(kept.key, tuple) and kept.key[0] == "buffer" and kept.producer is n:
                own[pos[n]] += kept.nbytes
            first_saver.setdefault(kept.key, (pos[n], kept.nbytes))
    freed_at: dict[str, list[tuple[int, int]]] = {}
    for i, b in first_saver.values():
        freed_at.setdefault(part_of.get(nodes[i]), []).append((i, b))
    out: dict[str, int] = {}
    for n in nodes:
        part = part_of.get(n)
        if part is None or n not in flows:
            continue
        i = pos[n]
        freed = sum(b for j, b in freed_at.get(part, ()) if j > i)
        out[part] = max(out.get(part, 0), live[i] + own[i] - freed)
    return out


def kept_outputs(program: Program, part_of: dict) -> dict[str, int]:
    """Per part, the bytes of the program's user outputs it makes that no op keeps for backward (the
    logits next to the loss): the runtime returns every microbatch's outputs, so they live to the end
    of the step. One batch of the program's shapes."""
    saved = SavedTensors(program)
    kept = {k.key for n in program.graph.nodes for k in saved.of(n)}
    outs = program.graph.output_node().args[0]
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    got: dict[str, int] = {}
    seen = set()
    for b, node in zip(program.outputs, outs):
        if b.kind != "user" or not isinstance(node, torch.fx.Node):
            continue
        val = node.meta.get(meta.VAL)
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            continue  # a scalar: the loss
        for k in saved.value(node):
            if k.key not in kept and k.key not in seen:
                seen.add(k.key)
                part = part_of.get(node, "post")
                got[part] = got.get(part, 0) + k.nbytes
    return got
