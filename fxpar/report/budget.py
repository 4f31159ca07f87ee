"""What one rank spends: FLOPs per stage, communication per training step, memory for parameters,
gradients and optimizer states, and activation memory under each recompute policy.

Reads a compiled model (duck-typed: ``plan``, ``pipeline``, ``program``, ``result``, ``schedule``,
``pp_rank``, ``m``, ``memory()``) or a traced :class:`~fxpar.ir.program.Program`, and ``fxpar.cost`` on
their nodes. Every figure is a prediction of the cost model except ``measured`` memory, which
``memory()`` gives only once a step has run.
"""

from __future__ import annotations

from fxpar.cost.comm import data_parallel_collectives, pipeline_transfers, step_collectives
from fxpar.cost.predict import RECOMPUTE, activation_memory
from fxpar.ir import meta
from fxpar.ir.program import Program, iter_nodes
from fxpar.ir.rank_view import view_of
from fxpar.report.table import columns, human


def graph_flops(gm) -> tuple[int, int]:
    """(forward, backward) FLOPs of one run of ``gm``, higher-order-op bodies included."""
    fwd = bwd = 0
    for node in iter_nodes(gm):
        cost = node.meta.get(meta.COST, meta.ZERO_COST)
        fwd, bwd = fwd + cost.flops, bwd + cost.bwd_flops
    return fwd, bwd


def stage_flops(compiled) -> list[dict]:
    """Per pipeline stage: forward and backward FLOPs of one microbatch on one TP rank (``compiled``: a
    :class:`~fxpar.ir.rank_view.RankView` or a model giving one)."""
    rows = []
    for s in view_of(compiled).pipeline.stages:
        fwd, bwd = graph_flops(s.gm)
        rows.append({"stage": s.index, "pp_rank": s.rank, "flops": fwd, "bwd_flops": bwd})
    return rows


def format_flops(compiled) -> str:
    v = view_of(compiled)
    rows = stage_flops(v)
    tp, m = v.plan.tp, v.microbatches
    fwd, bwd = graph_flops(v.result.traced.gm)
    lines = [("stage", "pp rank", "fwd FLOPs", "bwd FLOPs")]
    lines += [(str(r["stage"]), str(r["pp_rank"]), human(r["flops"]), human(r["bwd_flops"])) for r in rows]
    mine = [r for r in rows if r["pp_rank"] == v.pp_rank]
    text = [f"compute per microbatch on one TP rank (unsharded model: forward {human(fwd)}FLOPs, backward "
            f"{human(bwd)}FLOPs{f', over tp={tp}' if tp > 1 else ''})", "", columns(lines, left=-1)]
    text.append(f"pp rank {v.pp_rank} per step ({m} microbatches): forward "
                f"{human(m * sum(r['flops'] for r in mine))}FLOPs, backward "
                f"{human(m * sum(r['bwd_flops'] for r in mine))}FLOPs")
    return "\n".join(text)


def trainable(compiled) -> tuple[int, int]:
    """(entries, bytes per entry) of the trainable tensors this rank's stages hold, each tensor once."""
    v = view_of(compiled)
    program, seen = v.program, {}
    for s in v.my_stages():
        for fqn in s.params:
            t = program.tensor(fqn)
            if t.requires_grad:
                seen[id(t)] = t
    numel = sum(t.numel() for t in seen.values())
    return numel, next((t.element_size() for t in seen.values()), 4)


def communication(compiled) -> list[dict]:
    """Predicted communication of one training step on this rank: TP and ZeRO-3 collectives in the
    graphs, the data-parallel engine's reductions and gathers, and the pipeline's sends (rows of
    :func:`fxpar.cost.comm.step_collectives`)."""
    v = view_of(compiled)
    plan, stages = v.plan, v.my_stages()
    numel, size = trainable(v)
    return (step_collectives([s.gm for s in stages], v.microbatches)
            + data_parallel_collectives(numel, size, plan.dp * plan.cp, plan.zero, plan.dp_replicate)  # over dp x cp
            + pipeline_transfers(stages, v.microbatches))


def format_communication(rows: list[dict], microbatches: int, measured: dict | None = None) -> str:
    head = f"communication per step, predicted ({microbatches} microbatches; sent: bytes this rank sends)"
    if not rows:
        return head + ": none"
    lines = [("axis", "collective", "of", "payload", "sent")]
    lines += [(r["axis"], r["collective"], r["what"], human(r["payload"], "B"), human(r["sent"], "B")) for r in rows]
    text = [head, "", columns(lines, left=2), f"total sent per step: {human(sum(r['sent'] for r in rows), 'B')}"]
    if measured:
        text.append("data-parallel payload measured in the last step: "
                    + ", ".join(f"{k} {human(v, 'B')}" for k, v in measured.items()))
    return "\n".join(text)


def format_memory(mem: dict) -> str:
    lines = []
    for kind, label in (("predicted", "predicted"), ("measured", "measured after the last step")):
        if mem.get(kind):
            lines.append(f"memory per rank, {label}: "  # no frozen weights: no "frozen 0B"
                         + ", ".join(f"{k} {human(v, 'B')}" for k, v in mem[kind].items() if v or k != "frozen"))
    return "\n".join(lines)


def activations(program: Program, compiled=None) -> dict:
    """Predicted activation memory per recompute policy: of this rank's stages and schedule for a
    compiled model, of one forward and backward of the whole program for a traced one."""
    if compiled is None:
        return activation_memory(program)
    v = view_of(compiled)
    stages = {s.index: {n.name for n in iter_nodes(s.gm) if n.op == "call_function"} for s in v.my_stages()}
    return activation_memory(v.program, stages, v.actions)


def format_activations(acts: dict, chosen: str | None = None, context: str = "") -> str:
    lines = [("recompute", "per microbatch", "recomputed", "peak")]
    for policy in RECOMPUTE:
        a = acts[policy]
        mark = " (plan)" if policy == chosen else ""
        lines.append((policy + mark, human(sum(a["per_microbatch"].values()), "B"),
                      human(max(a["transient"].values(), default=0), "B"), human(a["peak"], "B")))
    return f"activation memory per rank, predicted{context}\n\n" + columns(lines, left=0)
