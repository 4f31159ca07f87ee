"""The stage table of a pipelined program: what each stage runs, holds, costs and sends.

Reads the :class:`~fxpar.ir.stage.PipelineProgram` (routing tables and the predicted per-microbatch
times the compiler wrote on each stage) and node ``val`` for boundary tensors.
"""

from __future__ import annotations

from fxpar.ir.stage import PipelineProgram, StageSpec
from fxpar.report.graph import describe_val
from fxpar.report.table import columns, human


def _boundary(stage: StageSpec) -> list[str]:
    """'name f32[2, 8, 64] 4.10KB -> 2,3' for each value the stage sends on (per microbatch, per receiver)."""
    vals = {n.name: n.meta.get("val") for n in stage.output_nodes()}
    return [f"{name} {describe_val(vals[name])} {human(b, 'B')} -> {','.join(map(str, cons))}"
            for name, b, cons in stage.sends()]


def stage_rows(pipeline: PipelineProgram, params_of) -> list[dict]:
    """One row per stage; ``links`` on each: bytes it sends per microbatch to each later stage, read
    from the routing table (what the runtime sends), beside the cost model's ``recv_bytes`` /
    ``send_bytes``."""
    links = pipeline.links()
    rows = []
    for s in pipeline.stages:
        nxt = pipeline.stages[s.index + 1].first_module if s.index + 1 < len(pipeline.stages) else "(end)"
        rows.append({
            "stage": s.index, "rank": s.rank, "from": s.first_module or "(start)", "to": nxt,
            "params": sum(params_of(f) for f in s.params), "fwd_s": s.fwd_time, "bwd_s": s.bwd_time,
            "transfer_s": s.transfer_time,
            "recv_bytes": s.recv_bytes, "send_bytes": s.send_bytes, "sends": _boundary(s),
            "links": {to: b for (frm, to), b in sorted(links.items()) if frm == s.index},
            "tied": sorted(f for f in s.params if f in pipeline.tied), "modules": list(s.modules),
        })
    return rows


def _secs(s: float) -> str:
    return f"{s * 1e3:.2f}ms" if s >= 1e-3 else f"{s * 1e6:.1f}us"


def format_stage_table(rows: list[dict], predicted: dict | None = None, schedule: str = "",
                       microbatches: int = 0) -> str:
    head = ("stage", "rank", "modules", "params", "fwd", "bwd", "transfer", "recv", "send")
    lines = [head]
    for r in rows:
        last = r["modules"][-1] if r["modules"] else r["from"]
        span = r["from"] if last == r["from"] else f"{r['from']} .. {last}"
        lines.append((str(r["stage"]), str(r["rank"]), span, human(r["params"]),
                      _secs(r["fwd_s"]), _secs(r["bwd_s"]), _secs(r["transfer_s"]), human(r["recv_bytes"], "B"),
                      human(r["send_bytes"], "B")))
    text = [columns(lines, left=2)]
    totals = [r["fwd_s"] + r["bwd_s"] + r["transfer_s"] for r in rows]
    text.append(f"\nslowest stage / mean: {max(totals) / (sum(totals) / len(totals)):.3f} (per microbatch, "
                "fwd + bwd + transfer)")
    if predicted:
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
