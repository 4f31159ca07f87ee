"""Context parallelism on this rank, as ``fxpar inspect`` shows it: the chunk layout of each sequence and every
key/value gather the pass put before an attention, with its shape and bytes.

Reads the rank's stage graphs (the gathers are ``fxpar::all_gather_rs_bwd`` nodes on a ``cp:`` group) and
the mesh; writes nothing.
"""

from __future__ import annotations

import torch.fx

from fxpar.ir import meta
from fxpar.ir.ops import collective_kind
from fxpar.ir.program import layer_of
from fxpar.report.table import human


def chunk_layout(seq: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The token ranges cp rank ``rank`` holds of a ``seq``-token sequence: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` (the head and tail chunks that balance causal attention)."""
    c = seq // (2 * cp)
    return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def cp_rows(view) -> list[dict]:
    """One row per key/value gather on this rank's stages: stage, layer, the gathered node, its whole shape,
    its payload bytes and the bytes this rank sends for it per microbatch (forward; backward's reduce-scatter
    sends as many)."""
    cp, rows = view.plan.cp, []
    for stage in view.my_stages():  # the graphs recompute outlined each layer into are walked too
        nodes = [n for gm in stage.gm.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes]
        for node in nodes:
            if collective_kind(node) != "all_gather_rs_bwd" or not str(node.args[1]).startswith("cp:"):
                continue
            val = node.meta.get(meta.VAL)
            payload = val.numel() * val.element_size() if val is not None else 0
            stack = node.args[0].meta.get("nn_module_stack") or {}
            module = next(reversed(stack.values()))[0] if stack else ""
            rows.append({"stage": stage.index, "layer": layer_of(module) or module, "gathers": node.args[0].name,
                         "shape": tuple(val.shape) if val is not None else (), "seq": int(val.shape[node.args[2]])
                         if val is not None else 0, "bytes": payload, "sent": payload * (cp - 1) // cp})
    return rows


def cp_table(view) -> str:
    """The chunk layout and the gathers of :func:`cp_rows`, as text."""
    rows, cp, rank = cp_rows(view), view.plan.cp, view.mesh.cp_rank
    seq = rows[0]["seq"] if rows else 0
    ranges = " and ".join(f"[{a}, {b})" for a, b in chunk_layout(seq, cp, rank)) if seq else "-"
    lines = [f"context parallel: cp={cp}, this rank is cp rank {rank} of group {view.mesh.group_name('cp')}: "
             f"tokens {ranges} of each {seq}-token sequence (chunks {rank} and {2 * cp - 1 - rank} of {2 * cp}); "
             "keys and values gathered for attention, each rank sending (cp - 1) / cp of them"]
    head = ("stage", "layer", "gathers", "whole shape", "payload", "sent fwd", "sent bwd")
    body = [(str(r["stage"]), r["layer"], r["gathers"], "x".join(map(str, r["shape"])), human(r["bytes"]) + "B",
             human(r["sent"]) + "B", human(r["sent"]) + "B") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    lines.append(f"total: {len(rows)} gathers, {human(sum(r['sent'] for r in rows))}B sent per microbatch each way")
    return "\n".join(lines)
