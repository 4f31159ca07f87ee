"""Context parallelism on this rank, as ``fxpar inspect`` shows it: the chunk layout of each sequence, every
key/value gather or Ulysses all-to-all the pass put around an attention, with its shape and bytes, and why an
attention keeps the all-gather under ``cp_attention="ulysses"``.

Reads the rank's stage graphs (the gathers are ``fxpar::all_gather_rs_bwd`` nodes on a ``cp:`` group, Ulysses'
all-to-alls ``fxpar::all_to_all`` nodes; each attention says on its node how it reads the sequence) and the
mesh; writes nothing.
"""

from __future__ import annotations

import torch.fx

from fxpar.ir import meta
from fxpar.ir.ops import collective_kind
from fxpar.ir.program import layer_of
from fxpar.report.table import human

CP_ATTENTION = "fxpar.cp_attention"  # on each attention node under Ulysses (fxpar.passes.cp_ulysses.META_KEY)


def chunk_layout(seq: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The token ranges cp rank ``rank`` holds of a ``seq``-token sequence: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp`` (the head and tail chunks that balance causal attention)."""
    c = seq // (2 * cp)
    return [(rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]


def cp_rows(view) -> list[dict]:
    """One row per key/value gather (``kind`` "all-gather") and per Ulysses all-to-all (``kind``
    "all-to-all": queries, keys and values to heads, the output back) on this rank's stages: stage, layer,
    what it moves, its shape (whole for a gather, this rank's for an all-to-all), its payload bytes and the
    bytes this rank sends for it per microbatch (forward; backward's reduce-scatter or all-to-all sends as
    many)."""
    cp, rows = view.plan.cp, []
    for stage, node in _cp_nodes(view):
        kind = collective_kind(node)
        if kind not in ("all_gather_rs_bwd", "all_to_all") or not str(node.args[1]).startswith("cp:"):
            continue
        gather = kind == "all_gather_rs_bwd"
        val = node.meta.get(meta.VAL) if gather else node.args[0].meta.get(meta.VAL)
        payload = val.numel() * val.element_size() if val is not None else 0
        src = node.args[0] if gather else _source(node)
        stack = src.meta.get("nn_module_stack") or {}
        module = next(reversed(stack.values()))[0] if stack else ""
        rows.append({"stage": stage, "layer": layer_of(module) or module, "gathers": src.name,
                     "kind": "all-gather" if gather else "all-to-all",
                     "shape": tuple(val.shape) if val is not None else (),
                     "seq": int(val.shape[node.args[2]]) if gather and val is not None else 0,
                     "bytes": payload, "sent": payload * (cp - 1) // cp})
    return rows


def _cp_nodes(view):
    """(stage index, node) for every node of this rank's stages (the graphs recompute outlined each layer
    into too)."""
    for stage in view.my_stages():
        for gm in stage.gm.modules():
            if isinstance(gm, torch.fx.GraphModule):
                for node in gm.graph.nodes:
                    yield stage.index, node


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """What an all-to-all moves: up through the layout ops that set it out (a view, a permute, the chunks
    of an attention's output put in rank order)."""
    cur = node.args[0]
    while packet_name(cur) in ("permute", "view", "reshape", "cat", "slice"):
        cur = cur.args[0][0] if packet_name(cur) == "cat" else cur.args[0]
    return cur


def packet_name(node) -> str:
    return getattr(getattr(node, "target", None), "__name__", "").split(".")[0] \
        if isinstance(node, torch.fx.Node) and node.op == "call_function" else ""


def kept_allgather(view) -> list[tuple[str, str]]:
    """(attention, why) for each attention that keeps the all-gather under ``cp_attention="ulysses"``."""
    return [(n.name, why[len("all-gather: "):]) for _, n in _cp_nodes(view)
            if str(why := n.meta.get(CP_ATTENTION, "")).startswith("all-gather: ")]


def cp_table(view) -> str:
    """The chunk layout, the gathers and all-to-alls of :func:`cp_rows`, and the attentions that keep the
    all-gather under Ulysses (with why), as text."""
    rows, cp, rank = cp_rows(view), view.plan.cp, view.mesh.cp_rank
    seq = max([r["seq"] for r in rows] + [_ulysses_seq(view)])
    ranges = " and ".join(f"[{a}, {b})" for a, b in chunk_layout(seq, cp, rank)) if seq else "-"
    how = {"allgather": "keys and values gathered for attention, each rank sending (cp - 1) / cp of them",
           "ulysses": "queries, keys and values sent to their heads' rank by all-to-all where cp divides the "
                      "heads (Ulysses: each rank attends with heads / cp heads over the whole sequence), each "
                      "rank sending (cp - 1) / cp of each"}
    how["auto"] = "per attention, whichever sends fewer bytes: " + how["ulysses"] + "; else " + how["allgather"]
    how = how[view.plan.cp_attention]
    lines = [f"context parallel: cp={cp}, this rank is cp rank {rank} of group {view.mesh.group_name('cp')}: "
             f"tokens {ranges} of each {seq}-token sequence (chunks {rank} and {2 * cp - 1 - rank} of {2 * cp}); "
             + how]
    head = ("stage", "layer", "moves", "kind", "shape", "payload", "sent fwd", "sent bwd")
    body = [(str(r["stage"]), r["layer"], r["gathers"], r["kind"], "x".join(map(str, r["shape"])),
             human(r["bytes"]) + "B", human(r["sent"]) + "B", human(r["sent"]) + "B") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    n_ag = sum(r["kind"] == "all-gather" for r in rows)
    lines.append(f"total: {n_ag} gathers, {len(rows) - n_ag} all-to-alls, "
                 f"{human(sum(r['sent'] for r in rows))}B sent per microbatch each way")
    lines += [f"kept the all-gather: {name}: {why}" for name, why in kept_allgather(view)]
    return "\n".join(lines)


def _ulysses_seq(view) -> int:
    """The sequence length a Ulysses attention reads whole (0 without one)."""
    for _, n in _cp_nodes(view):
        val = n.meta.get(meta.VAL)
        if n.meta.get(CP_ATTENTION) == "ulysses" and val is not None:
            return int(val.shape[-2])
    return 0
