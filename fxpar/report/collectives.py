"""Collectives of a tensor-parallel program, per layer: what each layer communicates in forward and
in backward, and how many bytes (the full tensor each collective works on, in its wire format)."""

from __future__ import annotations

from collections import defaultdict

import torch

from fxpar.cost.comm import collective_events
from fxpar.ir.program import layer_of
from fxpar.report.table import human


def collective_rows(gm: torch.fx.GraphModule) -> list[dict]:
    rows: dict[str, dict] = defaultdict(lambda: {"forward": defaultdict(int), "backward": defaultdict(int),
                                                 "forward_bytes": 0, "backward_bytes": 0})
    for e in collective_events(gm):
        row = rows[layer_of(e["module"])]
        for side in ("forward", "backward"):
            if e[side]:
                row[side][e[side]] += 1
                row[f"{side}_bytes"] += e[f"{side}_bytes"]  # wire bytes: int8 where quantized
    return [{"layer": layer, "forward": dict(r["forward"]), "backward": dict(r["backward"]),
             "forward_bytes": r["forward_bytes"], "backward_bytes": r["backward_bytes"]}
            for layer, r in rows.items()]


def format_collective_rows(rows: list[dict]) -> str:
    def counts(d: dict) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(d.items())) or "-"
    head = ("layer", "forward", "fwd bytes", "backward", "bwd bytes")
    body = [(r["layer"], counts(r["forward"]), human(r["forward_bytes"]) + "B", counts(r["backward"]),
             human(r["backward_bytes"]) + "B") for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    total_f = sum(r["forward_bytes"] for r in rows)
    total_b = sum(r["backward_bytes"] for r in rows)
    lines.append(f"total: forward {human(total_f)}B, backward {human(total_b)}B per microbatch")
    return "\n".join(lines)
