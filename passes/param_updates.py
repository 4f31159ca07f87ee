"""Under ZeRO-3, and in a pipeline that runs several forwards before their backwards, a forward's in-place
update of a parameter's detached value becomes an out-of-place op (:func:`needed`).

Reads: ``get_attr`` nodes of the stage's parameters, mutating ops (their schema) and ``val``. Writes: each
in-place op whose mutated argument is ``detach(parameter)`` (gemma3n's ``w.data.clamp_(-c, c)``, which
:mod:`fxpar.frontend.data_reads` captures as ``clamp_(detach(w))``) replaced by its out-of-place op
``u = clamp(detach(w))``; the parameter's later reads read ``w - detach(w) + u``: the updated value, with the
gradient reaching ``w`` as in eager, where it is taken at the updated value.

Why: ZeRO-3 replaces each parameter by a view of its gathered bucket (``split_with_sizes``: one of several
views), which autograd refuses to use once it is updated in place, and its regathering would read the bucket
again in backward, without the update. The out-of-place value is the layer's own tensor: backward saves it.
In a pipeline stage that runs a second microbatch's forward before the first one's backward (GPipe, 1F1B),
the second update bumps the version of the parameter the first backward saved (``detach`` shares it; eager's
``.data`` would not), and autograd refuses the saved value ("modified by an inplace operation").

What differs from eager: the update is not written into the rank's parameter or shard (eager keeps it).
The forward applies it again before every use, so a projection such as a clamp gives eager's numbers while the
optimizer keeps the weight inside its range; where it steps a weight out of it, eager's next step starts from
the projected weight and this program's from the stepped one. An in-place op with no out-of-place form is a
PlanError naming it.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.op_classes import writes_first
from fxpar.ir.schedule import microbatches
from fxpar.ir.stage import StageSpec

aten = torch.ops.aten


def _out_of_place(node: torch.fx.Node):
    name = node.target._schema.name.split("::")[-1]
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    op = getattr(packet, node.target._overloadname, None) if packet is not None else None
    if op is None:
        raise PlanError(f"{node.meta.get(meta.MODULE) or 'the model'} updates a parameter in place in its forward "
                        f"with {node.target}, which has no out-of-place form, so neither ZeRO-3 (on the gathered "
                        "parameter) nor a pipeline running several microbatches' forwards before their backwards "
                        "can run it: use zero=1 or zero=2 (they keep whole parameters), and one microbatch")
    return op


def needed(plan, program) -> bool:
    """ZeRO-3, or a pipeline whose stages run more than one microbatch's forward before its backward and a
    ``program`` that updates a detached value in place."""
    if plan.zero == 3:
        return True
    return plan.pp > 1 and microbatches(plan) > 1 and program is not None and any(
        writes_first(n) and n.args and getattr(n.args[0], "target", None) is aten.detach.default
        for n in program.graph.nodes)


def param_updates(stage: StageSpec, ctx=None) -> StageSpec:
    graph = stage.gm.graph
    params = {n: n for n in graph.nodes if n.op == "get_attr" and n.target in set(stage.params)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    # a value that stands for a parameter's detached value -> the parameter
    detached = {n: n.args[0] for n in graph.nodes
                if n.target is aten.detach.default and n.args and n.args[0] in params}
    current = dict(params)  # parameter -> the node its later reads read
    for node in list(graph.nodes):
        if not (writes_first(node) and node.args and node.args[0] in detached):
            continue
        target, param = node.args[0], detached[node.args[0]]
        op = _out_of_place(node)
        with graph.inserting_after(node):
            updated = graph.call_function(op, node.args, node.kwargs)
        with graph.inserting_after(updated):
            fresh = graph.call_function(aten.detach.default, (param,))
        with graph.inserting_after(fresh):
            zero = graph.call_function(aten.sub.Tensor, (param, fresh))
        with graph.inserting_after(zero):
            value = graph.call_function(aten.add.Tensor, (zero, updated))
        for new in (updated, fresh, zero, value):
            new.meta = {k: v for k, v in node.meta.items() if k != meta.COST}
        later = [u for u in graph.nodes if u in order and order[u] > order[node]]
        for user in later:
            user.replace_input_with(target, updated)
            user.replace_input_with(node, updated)
            user.replace_input_with(current[param], value)
        detached[updated], current[param] = param, value
        graph.erase_node(node)
        if not target.users:
            graph.erase_node(target)
    stage.gm.recompile()
    return stage
