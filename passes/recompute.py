"""Activation recompute as a stage pass: each repeated layer's forward runs again in backward.

Reads: a stage's graph, ``fxpar.module`` on its nodes (the owner FQN), and the whole program
(``ctx.program``) to tell which modules are repeated layers. Writes: per run of nodes owned by one layer,
a submodule ``recompute_<i>`` (a :class:`Recomputed` wrapping the layer's nodes outlined into a
``GraphModule``), one ``call_module`` node where the layer's last node was and a ``getitem`` per value
the rest of the stage reads. Parameters stay ``get_attr`` nodes of the stage and reach the layer as
arguments, so the optimizer, ZeRO and checkpoints see the stage's parameters as before.

Repeated layers are found from the owner FQNs alone: ``<container>.<i>`` where the program has owners
under at least two indices of ``<container>`` (``model.layers.3``, ``encoder.block.0``, ``h.11``); the
outermost such prefix names the layer (an expert ``...layers.3.mlp.experts.7`` belongs to
``...layers.3``).

Modes (``Plan.recompute``):

- ``layer``: the outlined layer runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.
  Backward keeps only the layer's inputs (the residual stream, the shared mask and rotary tables) and
  runs the whole forward of the layer again. TP collectives inside the layer run again too, as in
  Megatron's full recompute: every rank of a TP group runs the same stage program and backward visits
  the layers in the same order on each, so the recomputed collectives match; saving their outputs
  instead would keep two hidden-sized tensors per layer (the attention and MLP all-reduces), three times
  the layer input this mode is meant to be left with.
- ``selective``: the same regions under ``create_selective_checkpoint_contexts`` with
  :func:`policy`: outputs of matmuls and attention (:func:`saved_op`), and of TP collectives (as costly
  as a matmul and a message each), are saved; every other op (norms, activations, rotary, residual
  adds, casts) is recomputed.

ZeRO-3: this pass runs after ``zero3`` and moves each bucket's ``gather_params`` (with its slices and
views) into the layer that alone reads it. The layer's arguments are then its flat shard, not the
gathered bucket, so nothing holds the gathered parameters from forward to backward; recompute gathers
the bucket again in backward, the one regather per bucket ZeRO-3 makes without recompute. Both modes
recompute the gather rather than save it. A bucket read by several layers (``bucket_mb`` merging
layers) stays gathered outside and is held until backward; prefetching is lost for moved gathers (the
gather is issued where the layer starts).

Mixed precision: torch's checkpoint records the autocast state of the forward and recomputes under it,
so bf16 autocast (the pipeline runtime's) needs nothing here.

Pipelines: stage graphs are outlined like any graph (a layer cut by a stage boundary is one region per
stage). ``layer`` works with every schedule, the zero-bubble ones (input and weight gradients in two
backward passes) included; ``selective`` is refused with those, since torch's selective checkpoint
allows one backward pass through a region.
"""

from __future__ import annotations

import functools
import operator
import re

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import kept_by_selective
from fxpar.ir.program import graph_module
from fxpar.ir.schedule import SPLIT_BACKWARD, schedule_record  # noqa: F401 (SPLIT_BACKWARD: read by fxpar.planner.feasibility)
from fxpar.ir.stage import StageSpec

__all__ = ["Recomputed", "layer_units", "policy", "recompute", "saved_op", "unit_of"]

_INDEX = re.compile(r"^\d+$")


saved_op = kept_by_selective  # whether selective recompute keeps an op's output


def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The selective-recompute policy for ``create_selective_checkpoint_contexts``."""
    return CheckpointPolicy.MUST_SAVE if saved_op(func) else CheckpointPolicy.PREFER_RECOMPUTE


class Recomputed(torch.nn.Module):
    """One outlined layer, run under activation checkpointing when autograd records it."""

    def __init__(self, body: torch.fx.GraphModule, mode: str):
        super().__init__()
        self.body, self.mode = body, mode

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.body(*args)  # inference: nothing is saved, nothing to recompute
        if self.mode == "selective":
            return checkpoint(self.body, *args, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        return checkpoint(self.body, *args, use_reentrant=False)


def layer_units(owners) -> set[str]:
    """Containers (``model.layers``) with owners under at least two integer indices."""
    seen: dict[str, set[str]] = {}
    for owner in owners:
        parts = owner.split(".") if owner else []
        for k, p in enumerate(parts):
            if k and _INDEX.match(p):
                seen.setdefault(".".join(parts[:k]), set()).add(p)
    return {c for c, idx in seen.items() if len(idx) >= 2}


def unit_of(owner: str | None, containers: set[str]) -> str | None:
    """The repeated layer ``owner`` lies in (outermost), or None."""
    parts = owner.split(".") if owner else []
    for k in range(1, len(parts)):
        if _INDEX.match(parts[k]) and ".".join(parts[:k]) in containers:
            return ".".join(parts[:k + 1])
    return None


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.all_input_nodes)


def _is_tensor_attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op != "get_attr":
        return False
    obj = gm
    for p in str(node.target).split("."):
        obj = getattr(obj, p, None)
    return isinstance(obj, torch.Tensor)


def _segments(gm: torch.fx.GraphModule, containers: set[str]) -> list[tuple[str, list[torch.fx.Node]]]:
    """Runs of compute nodes owned by one layer (nodes of no layer between two of its own join it), each
    with the weight-only nodes (computed from parameters alone: ZeRO-3 gathers, slices, views) that only
    it reads."""
    nodes = list(gm.graph.nodes)
    weight_only: set[torch.fx.Node] = set()
    for n in nodes:
        if _is_tensor_attr(gm, n):
            weight_only.add(n)
        elif n.op == "call_function" and _inputs(n) and all(i in weight_only for i in _inputs(n)):
            weight_only.add(n)
    runs: list[tuple[str, list[torch.fx.Node]]] = []
    current, pending = None, []
    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr") or n in weight_only:
            continue
        u = unit_of(n.meta.get(meta.MODULE), containers)
        if u is None:
            pending.append(n)
        elif current is not None and u == current[0]:
            current[1].extend(pending + [n])
            pending = []
        else:
            current, pending = (u, [n]), []
            runs.append(current)
    where = {n: i for i, (_, run) in enumerate(runs) for n in run}
    for n in reversed(nodes):  # views before slices before gathers: users are decided first
        if n in weight_only and n.op != "get_attr" and n.users:
            homes = {where.get(u, -1) for u in n.users}
            if len(homes) == 1 and -1 not in homes:
                where[n] = homes.pop()
    members: list[list[torch.fx.Node]] = [[] for _ in runs]
    for n in nodes:
        if n in where:
            members[where[n]].append(n)
    return [(u, m) for (u, _), m in zip(runs, members)]


def _outline(gm: torch.fx.GraphModule, unit: str, seg: list[torch.fx.Node], index: int, mode: str) -> None:
    graph = gm.graph
    inside = set(seg)
    inputs: list[torch.fx.Node] = []
    for n in seg:
        for i in _inputs(n):
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in seg if any(u not in inside for u in n.users)]
    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i in inputs:
        if i.op == "get_attr" and not _is_tensor_attr(gm, i):  # a higher-order op's body: copied along
            env[i] = sub.get_attr(i.target)
        else:
            env[i] = sub.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in seg:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    body = graph_module(gm, sub, class_name="RecomputedLayer")
    name = f"recompute_{index}"
    gm.add_submodule(name, Recomputed(body, mode))
    args = tuple(i for i in inputs if env[i].op == "placeholder")
    with graph.inserting_after(seg[-1]):
        call = graph.call_module(name, args)
    call.meta[meta.MODULE] = unit
    call.meta[meta.VAL] = tuple(o.meta.get(meta.VAL) for o in outputs)
    cursor = call
    for k, o in enumerate(outputs):
        with graph.inserting_after(cursor):
            cursor = graph.call_function(operator.getitem, (call, k))
        cursor.meta = {key: v for key, v in o.meta.items() if key in (meta.VAL, meta.MODULE, meta.NN_MODULE_STACK)}
        o.replace_all_uses_with(cursor)
    for n in reversed(seg):
        graph.erase_node(n)


def recompute(stage: StageSpec, ctx) -> StageSpec:
    """Outline every repeated layer of ``stage`` into a recomputed submodule (``ctx.plan.recompute``)."""
    mode = ctx.plan.recompute
    if mode not in ("layer", "selective"):
        return stage
    if mode == "selective" and schedule_record(ctx.plan.schedule).split_backward:
        raise PlanError(f"recompute='selective' with schedule {ctx.plan.schedule!r}: zero-bubble schedules run "
                        "each stage's backward in two passes (input gradients, then weight gradients), and "
                        "torch's selective checkpoint allows one backward through a region; use "
                        "recompute='layer' with this schedule, or schedule='1f1b' / 'interleaved_1f1b'")
    gm = stage.gm
    program_gm = ctx.program.gm if getattr(ctx, "program", None) is not None else gm
    containers = layer_units(n.meta.get(meta.MODULE) for n in program_gm.graph.nodes)
    for i, (unit, seg) in enumerate(_segments(gm, containers)):
        # a piece of a layer without a matmul or attention (a pipeline cut left it, e.g. one norm) is kept as
        # it is: recomputing it saves next to nothing, and under a zero-bubble schedule's split backward
        # torch's checkpoint was seen to fail on a lone RMSNorm ("6 tensors saved in forward, 1 in recompute")
        if any(n.op == "call_function" and saved_op(n.target) for n in seg):
            _outline(gm, unit, seg, i, mode)
    gm.graph.lint()
    gm.recompile()
    return stage
