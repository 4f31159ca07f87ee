"""The stage table of a pipelined program: what each stage runs, holds, costs and sends.

Reads the :class:`~fxpar.ir.stage.PipelineProgram` (routing tables and the predicted per-microbatch
times the compiler wrote on each stage), node ``val`` for boundary tensors, and the plan's price
(``compiled.predicted``) for its step.
"""

from __future__ import annotations

from fxpar.ir.errors import FxparError
from fxpar.ir.rank_view import view_of
from fxpar.ir.stage import PipelineProgram, StageSpec
from fxpar.report.graph import describe_val
from fxpar.report.table import columns, human


def _boundary(stage: StageSpec) -> list[str]:
    """'name f32[2, 8, 64] 4.10KB -> 2,3' for each value the stage sends on (per microbatch, per receiver)."""
    vals = {n.name: n.meta.get("val") for n in stage.output_nodes()}
    return [f"{name} {describe_val(vals[name])} {human(b, 'B')} -> {','.join(map(str, cons))}"
            for name, b, cons in stage.sends()]


def stage_ranks(spec, pp_rank: int) -> list[int]:
    """The global ranks that run pipeline rank ``pp_rank``'s stages: every rank of the ``dp x ep x pp x tp``
    mesh (:class:`~fxpar.ir.mesh.MeshSpec`) whose ``pp`` coordinate is ``pp_rank``, as
    ``DeviceMesh["pp"]``'s coordinate selects them."""
    return sorted(spec.rank_of(dp=d, ep=e, pp=pp_rank, tp=t) for d in range(spec.dp) for e in range(spec.ep)
                  for t in range(spec.tp))


def rank_ranges(ranks: list[int], most: int = 4) -> str:
    """``[0, 1, 4, 5]`` -> ``0-1,4-5``; past ``most`` runs, the first ones and the count."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ",".join(text) if len(text) <= most else ",".join(text[:most - 1]) + f",... ({len(ranks)} ranks)"


def stage_rows(pipeline: PipelineProgram, params_of, spec=None) -> list[dict]:
    """One row per stage; ``pp_rank``: the pipeline rank that runs it, ``ranks``: the global ranks that do
    (with ``spec``, the plan's :class:`~fxpar.ir.mesh.MeshSpec`); ``links`` on each: bytes it sends per
    microbatch to each later stage, read from the routing table (what the runtime sends), beside the cost
    model's ``recv_bytes`` / ``send_bytes``."""
    links = pipeline.links()
    rows = []
    for s in pipeline.stages:
        nxt = pipeline.stages[s.index + 1].first_module if s.index + 1 < len(pipeline.stages) else "(end)"
        rows.append({
            "stage": s.index, "pp_rank": s.rank, "ranks": stage_ranks(spec, s.rank) if spec is not None else None,
            "from": s.first_module or "(start)", "to": nxt,
            "params": sum(params_of(f) for f in s.params), "fwd_s": s.fwd_time, "bwd_s": s.bwd_time,
            "transfer_s": s.transfer_time,
            "recv_bytes": s.recv_bytes, "send_bytes": s.send_bytes, "sends": _boundary(s),
            "links": {to: b for (frm, to), b in sorted(links.items()) if frm == s.index},
            "tied": sorted(f for f in s.params if f in pipeline.tied), "modules": list(s.modules),
        })
    return rows


def _secs(s: float) -> str:
    return f"{s * 1e3:.2f}ms" if s >= 1e-3 else f"{s * 1e6:.1f}us"


def predicted_step(compiled) -> dict | None:
    """What the stage table says of the compiled plan's price (``compiled.predicted``, the plan's
    :class:`~fxpar.cost.estimate.Estimate`): the profile, step time and its parts, bubble, memory per rank,
    MFU; with ``error`` instead where the plan has no price (the reason). None for an object without one."""
    v = view_of(compiled)
    if v.estimate is None:
        return None
    device = v.result.predicted.get("device")
    try:
        e = v.estimate()
    except FxparError as err:
        return {"device": device, "error": str(err).splitlines()[0]}
    return {"device": device, "step_time": e.step_time, "bubble": e.bubble, "parts": dict(e.parts),
            "memory": dict(e.memory), "comm_bytes": dict(e.comm_bytes), "mfu": e.mfu, "fits": e.fits}


def format_stage_table(rows: list[dict], predicted: dict | None = None, schedule: str = "",
                       microbatches: int = 0) -> str:
    """The stage table: ``pp rank`` is the pipeline rank that runs a stage (its coordinate on the mesh's
    ``pp`` dimension), ``ranks`` the global ranks with that coordinate (each holds its dp / tp share)."""
    ranks = all(r.get("ranks") is not None for r in rows)
    head = ("stage", "pp rank", *(("ranks",) if ranks else ()), "modules", "params", "fwd", "bwd", "transfer",
            "recv", "send")
    lines = [head]
    for r in rows:
        last = r["modules"][-1] if r["modules"] else r["from"]
        span = r["from"] if last == r["from"] else f"{r['from']} .. {last}"
        lines.append((str(r["stage"]), str(r["pp_rank"]), *((rank_ranges(r["ranks"]),) if ranks else ()), span,
                      human(r["params"]),
                      _secs(r["fwd_s"]), _secs(r["bwd_s"]), _secs(r["transfer_s"]), human(r["recv_bytes"], "B"),
                      human(r["send_bytes"], "B")))
    text = [columns(lines, left=2)]
    totals = [r["fwd_s"] + r["bwd_s"] + r["transfer_s"] for r in rows]
    text.append(f"\nslowest stage / mean: {max(totals) / (sum(totals) / len(totals)):.3f} (per microbatch, "
                "fwd + bwd + transfer)")
    if predicted and "error" in predicted:
        text.append(f"predicted {schedule} step: none ({predicted['error']})")
    elif predicted:  # the plan's Estimate (fxpar.price): the number `fxpar plan` and the planner give
        text.append(f"predicted {schedule} step with {microbatches} microbatches on {predicted['device']}: "
                    f"{_secs(predicted['step_time'])}, bubble {100 * predicted['bubble']:.1f}%")
    text.append("bytes per boundary per microbatch (forward; gradients come back the same way where one flows):")
    for r in rows:
        for to, b in r.get("links", {}).items():
            text.append(f"  stage {r['stage']} -> {to}: {b} B ({human(b, 'B')})")
    for r in rows:
        for send in r["sends"]:
            text.append(f"  stage {r['stage']} sends {send}")
        if r["tied"]:
            text.append(f"  stage {r['stage']} shares {', '.join(r['tied'])} (gradients summed across stages)")
    return "\n".join(text)
