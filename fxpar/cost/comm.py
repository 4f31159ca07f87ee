"""Communication predicted from a graph: what each fxpar collective sends, in bytes.

Reads: a GraphModule whose fxpar op nodes (:mod:`fxpar.ir.ops`) carry ``meta["val"]`` on themselves or
on their input, and group names (sized by :func:`fxpar.ir.ops.group_size`). Writes nothing.

Pure prediction, from the graph alone: nothing here needs a process group, so ``fxpar plan``, the
report and a planner can price a plan for any world on one process.

* :func:`collective_bytes` gives raw payload bytes (the full, unsharded tensor each collective works
  on), :func:`collective_events` the same per node with the module it belongs to;
* :func:`ring_bytes` / :func:`collective_ring_bytes` turn them into what each rank sends under ring
  algorithms.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import FxparError
from fxpar.ir.numeric import nbytes
from fxpar.ir.ops import COLLECTIVE_OPS, collective_nodes, group_size

__all__ = ["COMMS", "collective_bytes", "collective_events", "collective_ring_bytes", "ring_bytes"]

# op -> (communication its forward does, communication its backward does); None: no communication.
COMMS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("all_reduce", None),
    "identity_fwd_all_reduce_bwd": (None, "all_reduce"),
    "all_gather": ("all_gather", None),
    "all_gather_rs_bwd": ("all_gather", "reduce_scatter"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "scatter_slice": (None, "all_gather"),
    # ZeRO-3: gathered for forward, gathered again for backward (fxpar.runtime.zero3), gradient
    # reduce-scattered: its backward payload counts twice
    "gather_params": ("all_gather", "all_gather+reduce_scatter"),
}


def _node_arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _full_bytes(kind: str, node: torch.fx.Node) -> int:
    """Bytes of the full (unsharded) tensor the node's collective works on: the larger of its input
    and its output, whichever of the two ``meta["val"]`` holds."""
    src = node.args[0] if node.args else None
    in_b = nbytes(src.meta.get(meta.VAL)) if isinstance(src, torch.fx.Node) else None
    out_b = nbytes(node.meta.get(meta.VAL))
    if in_b is None and out_b is None:
        raise FxparError(
            f"node {node.name} ({kind}) has no meta['val'] on it or its input; trace with torch.export / "
            "make_fx or run FakeTensorProp first"
        )
    if in_b is not None and out_b is not None:
        return max(in_b, out_b)
    n = group_size(_node_arg(node, 1, "group"))
    if in_b is not None:
        return in_b * n if kind in ("all_gather", "all_gather_rs_bwd", "gather_params") else in_b
    return out_b * n if kind in ("reduce_scatter", "scatter_slice") else out_b


def collective_events(gm: torch.fx.GraphModule) -> list[dict]:
    """Every fxpar op node with what it communicates: ``{"node", "kind", "module", "forward", "backward",
    "bytes"}`` where forward/backward name the collective each direction runs (None: none) and bytes
    is the full tensor's payload (as :func:`collective_bytes` counts it)."""
    out = []
    for kind, node in collective_nodes(gm):
        fwd, bwd = COMMS[kind]
        out.append({"node": node.name, "kind": kind, "module": node.meta.get(meta.MODULE, ""), "forward": fwd,
                    "backward": bwd, "bytes": _full_bytes(kind, node) if fwd or bwd else 0})
    return out


def collective_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """Raw payload bytes per fxpar op, summed over its nodes: the size of the full (unsharded) tensor
    each collective works on (the all-reduced tensor, the gathered output, the reduce-scattered input),
    whatever the algorithm. Ops whose forward does not communicate (``identity_fwd_all_reduce_bwd``,
    ``scatter_slice``) count 0. ``backward=True`` gives instead the payload of the collectives each
    node's backward will run (for a forward graph whose backward autograd derives from the ops)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in collective_nodes(gm):
        comm = COMMS[kind][1 if backward else 0]
        if comm is not None:
            out[kind] += _full_bytes(kind, node) * len(comm.split("+"))
    return out


def ring_bytes(comm: str, payload: int, n: int) -> int:
    """Bytes each rank sends for a collective of ``payload`` (full-tensor) bytes over ``n`` ranks
    with a ring algorithm: all-reduce ``2(n-1)/n * payload``, all-gather and reduce-scatter
    ``(n-1)/n * payload`` (rounded down)."""
    if comm == "all_reduce":
        return 2 * (n - 1) * payload // n
    if comm in ("all_gather", "reduce_scatter"):
        return (n - 1) * payload // n
    raise FxparError(f"unknown communication {comm!r}; use all_reduce, all_gather or reduce_scatter")


def collective_ring_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """As :func:`collective_bytes`, converted with :func:`ring_bytes` into bytes each rank sends,
    using each node's group size (:func:`~fxpar.ir.ops.group_size` of its group name)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in collective_nodes(gm):
        comm = COMMS[kind][1 if backward else 0]
        if comm is not None:
            n = group_size(_node_arg(node, 1, "group"))
            out[kind] += sum(ring_bytes(c, _full_bytes(kind, node), n) for c in comm.split("+"))
    return out
