"""Communication predicted from a graph: what each fxpar collective sends, in bytes.

Reads: a GraphModule whose fxpar op nodes (:mod:`fxpar.ir.ops`) carry ``meta["val"]`` on themselves or
on their input, and group names (sized by :func:`fxpar.ir.ops.group_size`). Writes nothing.

Pure prediction, from the graph alone: nothing here needs a process group, so ``fxpar plan``, the
report and a planner can price a plan for any world on one process.

* :func:`collective_bytes` gives raw payload bytes (the full, unsharded tensor each collective works
  on), :func:`collective_events` the same per node with the module it belongs to;
* :data:`RING` is the ring table (ring steps and the share of the full tensor each rank sends, per
  kind), read from the records of :mod:`fxpar.ir.collectives` as :data:`COMMS` is: :func:`ring_bytes` /
  :func:`collective_ring_bytes` / :func:`sent_bytes` turn payloads into what each rank sends with it,
  and :meth:`fxpar.cost.profiles.DeviceProfile.collective_time` times them;
* :func:`step_collectives`, :func:`data_parallel_collectives` and :func:`pipeline_transfers` give one
  training step's communication per rank: the graph's collectives (TP, ZeRO-3) times the microbatches,
  the data-parallel engine's gradient reduction and parameter gathering, the pipeline's sends.

Bytes are wire bytes: a node's wire format argument (its record's ``comm_dtype_arg``; ZeRO++ int8) counts
what :data:`fxpar.ir.wire.FORMATS` says the format costs (int8 codes plus one fp32 scale per block of every
rank's slice). An op that casts before it communicates (its record's ``cast_arg``: ZeRO-3's
``gather_params``) counts its gather in the gathered dtype; its backward the regather (the same) and the
reduce-scatter of the gradient in the shard's dtype (fp32 master weights: fp32), or in the format's
gradient format (``"int8+grads"``: int8). Every bucket's regather is counted, an upper bound: the runtime skips those
backward never asks for (an embedding's backward does not read its weight) and may keep the last
bucket from forward to backward (:mod:`fxpar.runtime.zero3`).
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.collectives import COLLECTIVES, collective
from fxpar.ir.collectives import COMMS as COMM_RECORDS
from fxpar.ir.errors import FxparError
from fxpar.ir.numeric import nbytes
from fxpar.ir.ops import COLLECTIVE_OPS, collective_kind, collective_nodes, group_size
from fxpar.ir.wire import wire_format

__all__ = ["COMMS", "KINDS", "RING", "collective_bytes", "collective_events", "collective_ring_bytes",
           "data_parallel_collectives", "payloads", "pipeline_transfers", "ring", "ring_bytes", "sent_bytes",
           "step_collectives"]

# The ring table, read from the records of fxpar.ir.collectives (ring algorithms on n ranks: steps of
# latency, and the share of the full tensor's bytes each rank sends as numerator, denominator). Every byte
# and time formula reads it.
RING = {name: c.ring for name, c in COMM_RECORDS.items()}
KINDS = tuple(RING)


def ring(kind: str, n: int) -> tuple[int, float]:
    """(steps of latency, share of the full tensor's bytes each rank sends) of ``kind`` on ``n`` ranks."""
    steps, num, den = RING[kind](n)
    return steps, num / den

# op -> (communication its forward does, communication its backward does, "+"-joined); None: no
# communication. From each op's record (fxpar.ir.collectives.COLLECTIVES).
COMMS: dict[str, tuple[str | None, str | None]] = {
    name: ("+".join(c.forward) or None, "+".join(c.backward) or None) for name, c in COLLECTIVES.items()
    if c.counted}


def _node_arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _full_bytes(kind: str, node: torch.fx.Node) -> int:
    """Bytes of the full (unsharded) tensor the node's collective works on: the larger of its input
    and its output, whichever of the two ``meta["val"]`` holds."""
    if "fxpar.collective_payload" in node.meta:  # a collective matmul (fxpar.ir.collective_matmul_ops.PAYLOAD)
        return node.meta["fxpar.collective_payload"]
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
    shape = collective(kind).shape
    if in_b is not None:
        return in_b * n if shape == "gather" else in_b
    return out_b * n if shape == "scatter" else out_b


def _val(node) -> torch.Tensor | None:
    v = node.meta.get(meta.VAL) if isinstance(node, torch.fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _full_numel(kind: str, node: torch.fx.Node, n: int) -> int:
    """Entries of the full tensor a gather produces or a reduce-scatter consumes."""
    src, out = _val(node.args[0] if node.args else None), _val(node)
    if collective(kind).shape == "gather":
        return src.numel() * n if src is not None else out.numel()
    return src.numel() if src is not None else out.numel() * n


def payloads(kind: str, node: torch.fx.Node, *, backward: bool = False) -> list[tuple[str, int]]:
    """(communication, payload bytes on the wire) for each collective the node's forward (or backward)
    runs, in :data:`COMMS` order; empty if it communicates nothing."""
    rec = collective(kind)
    comms = rec.backward if backward else rec.forward
    if not comms:
        return []
    n = group_size(_node_arg(node, 1, "group"))
    at = rec.comm_dtype_arg  # (a fused kernel counted as the op has arguments of its own, no wire format)
    fmt = None if at is None or collective_kind(node) != kind else wire_format(_node_arg(node, at, "comm_dtype"))
    sent = fmt.wire_bytes(_full_numel(kind, node, n), n) if fmt is not None else _full_bytes(kind, node)
    if rec.cast_arg is None or not backward:
        return [(c, sent) for c in comms]
    # a cast op's backward: the regather as its forward, then the gradient's reduction in the input's
    # dtype, or in the format's gradient format
    shard = _val(node.args[0])
    grad_fmt = None if fmt is None or fmt.grads is None else wire_format(fmt.grads)
    if grad_fmt is not None:
        grads = grad_fmt.wire_bytes(_full_numel(kind, node, n), n)
    else:
        grads = shard.numel() * n * shard.element_size() if shard is not None else _full_bytes(kind, node)
    return [(c, sent if c in rec.forward else grads) for c in comms]


def collective_events(gm: torch.fx.GraphModule) -> list[dict]:
    """Every fxpar op node with what it communicates: ``{"node", "kind", "module", "forward", "backward",
    "bytes", "forward_bytes", "backward_bytes"}`` where forward/backward name the collective(s) each
    direction runs (None: none), bytes is the full tensor's payload and forward/backward_bytes the wire
    bytes of each direction (as :func:`collective_bytes` counts them)."""
    out = []
    for kind, node in collective_nodes(gm):
        fwd, bwd = COMMS[kind]
        out.append({"node": node.name, "kind": kind, "module": node.meta.get(meta.MODULE, ""), "forward": fwd,
                    "backward": bwd, "bytes": _full_bytes(kind, node) if fwd or bwd else 0,
                    "forward_bytes": sum(b for _, b in payloads(kind, node)),
                    "backward_bytes": sum(b for _, b in payloads(kind, node, backward=True))})
    return out


def collective_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """Wire payload bytes per fxpar op, summed over its nodes: the size of the full (unsharded) tensor
    each collective works on (the all-reduced tensor, the gathered output, the reduce-scattered input),
    whatever the algorithm, in its wire format (int8 + scales where quantized). Ops whose forward does
    not communicate (``identity_fwd_all_reduce_bwd``, ``scatter_slice``) count 0. ``backward=True`` gives
    instead the payload of the collectives each node's backward will run (for a forward graph whose
    backward autograd derives from the ops)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in collective_nodes(gm):
        out[kind] += sum(b for _, b in payloads(kind, node, backward=backward))
    return out


def ring_bytes(comm: str, payload: int, n: int) -> int:
    """Bytes each rank sends for a collective of ``payload`` (full-tensor) bytes over ``n`` ranks
    with a ring algorithm (:data:`RING`): all-reduce ``2(n-1)/n * payload``, all-gather and
    reduce-scatter ``(n-1)/n * payload`` (rounded down)."""
    if comm not in RING:
        raise FxparError(f"unknown communication {comm!r}; use one of {', '.join(KINDS)}")
    _, num, den = RING[comm](n)
    return num * payload // den


def sent_bytes(comm: str, payload: float, n: int) -> float:
    """:func:`ring_bytes` unrounded, for a payload that is an estimate (0 on one rank)."""
    if n <= 1:
        return 0.0
    return payload * ring(comm, n)[1]


def collective_ring_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """As :func:`collective_bytes`, converted with :func:`ring_bytes` into bytes each rank sends,
    using each node's group size (:func:`~fxpar.ir.ops.group_size` of its group name)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in collective_nodes(gm):
        n = group_size(_node_arg(node, 1, "group"))
        out[kind] += sum(ring_bytes(c, b, n) for c, b in payloads(kind, node, backward=backward))
    return out


# ---- communication of one training step, per rank ----------------------------------------------------

def _row(axis: str, collective: str, what: str, payload: int, sent: int) -> dict:
    return {"axis": axis, "collective": collective, "what": what, "payload": payload, "sent": sent}


def step_collectives(gms, microbatches: int) -> list[dict]:
    """The graph collectives (TP's, ZeRO-3's gathers) of one training step over ``microbatches``, summed
    per (group axis, collective, forward/backward): ``{"axis", "collective", "what", "payload", "sent"}``
    with ``payload`` the full tensors' bytes and ``sent`` the bytes this rank sends (:func:`ring_bytes`).
    ``gms``: the graphs this rank runs (its pipeline stages), each run once per microbatch."""
    rows: dict[tuple[str, str, str], dict] = {}
    for gm in gms:
        for kind, node in collective_nodes(gm):
            group = _node_arg(node, 1, "group")
            axis, n = str(group).split(":")[0], group_size(group)
            for what in ("forward", "backward"):
                for c, b in payloads(kind, node, backward=what == "backward"):
                    payload = b * microbatches
                    row = rows.setdefault((axis, c, what), _row(axis, c, what, 0, 0))
                    row["payload"] += payload
                    row["sent"] += ring_bytes(c, payload, n)
    return list(rows.values())


def data_parallel_collectives(numel: int, element_size: int, dp: int, zero: int,
                              dp_replicate: int = 1) -> list[dict]:
    """The data-parallel engine's collectives of one step for ``numel`` trainable entries of
    ``element_size`` bytes on this rank (rows as :func:`step_collectives`'s). Gradients are reduced once
    per step: all-reduced (DDP, ZeRO-1) or reduce-scattered (ZeRO-2; NCCL's algorithm, the gloo path
    all-reduces); ZeRO-1/2 then all-gather the updated fp32 shards. ZeRO-3's collectives are graph nodes
    (:func:`step_collectives`), so it adds none here. HSDP (``dp_replicate`` > 1): :func:`hsdp_collectives`."""
    if dp_replicate > 1:
        return hsdp_collectives(numel, element_size, dp // dp_replicate, dp_replicate, zero)
    if dp == 1 or zero == 3:
        return []
    grads = numel * element_size
    reduce = "reduce_scatter" if zero == 2 else "all_reduce"
    rows = [_row("dp", reduce, "gradients", grads, ring_bytes(reduce, grads, dp))]
    if zero in (1, 2):
        rows.append(_row("dp", "all_gather", "parameters", 4 * numel, ring_bytes("all_gather", 4 * numel, dp)))
    return rows


def hsdp_collectives(numel: int, element_size: int, shard: int, replicas: int, zero: int) -> list[dict]:
    """HSDP's engine collectives of one step (``runtime/data_parallel.py``): ZeRO-1/2 reduce-scatter the
    gradients inside the shard group of ``shard`` ranks, all-reduce this rank's shard (1/shard of them)
    across the ``replicas``, ZeRO-1 gathers the reduced shards back whole, and the updated fp32 shards are
    all-gathered inside the shard group; ZeRO-3 (whose gathers and reduce-scatters are graph nodes) adds
    only the shards' all-reduce across the replicas."""
    grads = numel * element_size
    part = -(-numel // shard) * element_size  # this rank's shard, padded as the buckets pad
    rows = [] if zero == 3 or shard == 1 else [
        _row("dp_shard", "reduce_scatter", "gradients", grads, ring_bytes("reduce_scatter", grads, shard))]
    rows.append(_row("dp_replicate", "all_reduce", "gradient shards", part, ring_bytes("all_reduce", part, replicas)))
    if zero in (1, 2) and shard > 1:
        if zero == 1:
            rows.append(_row("dp_shard", "all_gather", "gradients", grads, ring_bytes("all_gather", grads, shard)))
        rows.append(_row("dp_shard", "all_gather", "parameters", 4 * numel, ring_bytes("all_gather", 4 * numel, shard)))
    return rows


def pipeline_transfers(stages, microbatches: int) -> list[dict]:
    """What ``stages`` (this rank's pipeline stages) send to stages on other ranks in one training step:
    activations forward (each output once per consuming rank) and the gradients of received
    activations backward; point-to-point, so ``sent`` equals ``payload``."""
    mine = {s.index for s in stages}
    acts = grads = 0
    for s in stages:
        for node, cons in zip(s.output_nodes(), s.consumers):
            acts += (nbytes(node.meta.get(meta.VAL)) or 0) * sum(1 for c in cons if c not in mine)
        phs = [n for n in s.gm.graph.nodes if n.op == "placeholder"]
        for ph, ref, needs in zip(phs, s.inputs, s.input_needs_grad):
            if needs and not ref.is_user:
                grads += nbytes(ph.meta.get(meta.VAL)) or 0
    rows = []
    if acts:
        rows.append(_row("pp", "send", "activations", acts * microbatches, acts * microbatches))
    if grads:
        rows.append(_row("pp", "send", "gradients", grads * microbatches, grads * microbatches))
    return rows
