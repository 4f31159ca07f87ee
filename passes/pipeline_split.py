"""Split a traced program into pipeline stages at given cuts, without touching the model.

Reads: ``fxpar.module`` (cut positions), ``fxpar.param`` (parameter placeholders), ``val``.
Writes: one ``GraphModule`` per stage (node meta copied) and the routing tables of
:class:`~fxpar.ir.stage.PipelineProgram`.

- Top-level nodes are assigned by position: a stage runs the nodes from its cut to the next, in graph
  (= execution) order. Parameters, buffers and constants become ``get_attr`` nodes under their
  canonical FQN in every stage that reads them, bound to the model's own tensors: checkpoints and
  optimisers see Hugging Face names, and a parameter read by two stages (tied embedding and LM head)
  lives on both.
- User inputs are given to every rank, so a stage reads them directly (labels go straight to the
  last stage). A value that a later stage can compute cheaply from what every stage has (user inputs,
  buffers, constants: an attention mask, rotary tables, position ids;
  ``fxpar.cost.boundary.recomputable`` states the rule) is recomputed there: the nodes it is made from
  are copied into that stage. Any other value computed on one stage and read by later ones (the hidden
  state, anything that depends on a parameter) is an output of its stage, sent straight to every stage
  that reads it, not relayed stage by stage; ``fxpar.cost.boundary.routed_bytes`` counts the same sends.
- A Python scalar read by a later stage: one the trace knew (a plain int in ``val``) is baked into the
  reading stage as a constant argument; a symbolic one (a data-dependent size, ``u0`` from an ``.item()``
  whose cone reads a parameter, so the reading stage cannot make it again) is an output like a tensor,
  which the pipeline runtime carries as a 0-d tensor and hands over as a Python scalar again
  (:mod:`fxpar.runtime.pipeline`, which also sends a tensor of a symbolic shape after its shape).
- ``fxpar.ir.analysis.grad_flow`` marks values through which a gradient flows (they depend on a trainable parameter);
  only those get gradients sent back.

Written here rather than with ``torch.fx.passes.split_module`` because stages need parameters as
``get_attr`` under their original FQNs (split_module passes lifted placeholders as inputs), a routing
table to any later stage, and higher-order-op bodies copied along.
"""

from __future__ import annotations

import torch
import torch.fx

from fxpar.cost.boundary import recomputable
from fxpar.cost.partition import cut_position, module_positions, top_nodes
from fxpar.ir import meta
from fxpar.ir.analysis import grad_flow
from fxpar.ir.errors import PlanError
from fxpar.ir.program import Program, graph_module
from fxpar.ir.stage import PipelineProgram, StageSpec, ValueRef


def set_nested(root: torch.nn.Module, fqn: str, value) -> None:
    *path, last = fqn.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p):
            mod.add_module(p, torch.nn.Module())
        mod = getattr(mod, p)
    if isinstance(value, torch.nn.Parameter):
        mod.register_parameter(last, value)
    elif isinstance(value, torch.Tensor):
        mod.register_buffer(last, value)
    else:
        setattr(mod, last, value)


def _static_scalar(node: torch.fx.Node) -> bool:
    """A value the trace knew as a plain Python int, float or bool (not a symbol): the same for every
    microbatch of this program's signature, so a reading stage takes it as a constant argument."""
    return type(node.meta.get(meta.VAL)) in (int, float, bool)


def _differentiable(val) -> bool:
    if val is None:  # not known: as before
        return True
    return isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)


def split_pipeline(program: Program, cuts: list[tuple[str, str]], stage_to_rank: list[int]) -> PipelineProgram:
    if len(stage_to_rank) != len(cuts) + 1:
        raise PlanError(f"{len(cuts)} cuts make {len(cuts) + 1} stages, but {len(stage_to_rank)} were placed")
    if any(b.kind == "buffer_mutation" for b in program.outputs):
        raise PlanError(f"{program.info.model_class} updates buffers in forward (e.g. running statistics); "
                        "pipeline stages cannot carry those updates yet: trace in a mode that does not")
    nodes = top_nodes(program)
    spans = module_positions(program)
    bounds = [0] + [cut_position(spans, c) for c in cuts] + [len(nodes)]
    if any(b >= e for b, e in zip(bounds, bounds[1:])):
        raise PlanError(f"cuts {cuts} leave an empty stage (positions {bounds})")
    stage_of: dict[torch.fx.Node, int] = {}
    for s in range(len(bounds) - 1):
        for n in nodes[bounds[s]:bounds[s + 1]]:
            stage_of[n] = s
    n_stages = len(bounds) - 1
    # a gradient crosses back only for a floating tensor: an int (a size) or an index tensor that depends on a
    # parameter is in grad_flow's cone but has no gradient to send
    grad = {n for n in grad_flow(program) if _differentiable(n.meta.get(meta.VAL))}
    recompute = recomputable(program)
    binding = {b.placeholder: b for b in program.inputs}
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    flat_outputs = list(output_node.args[0])
    user_positions = [i for i, b in enumerate(program.outputs) if b.kind == "user"]

    # which nodes each stage must return: read by a later stage or by the program's output
    outputs: list[list[torch.fx.Node]] = [[] for _ in range(n_stages)]
    consumers: dict[torch.fx.Node, set[int]] = {}
    for node in nodes:
        for user in node.users:
            if user.op == "output" or stage_of.get(user, stage_of[node]) != stage_of[node]:
                if user.op != "output" and stage_of[user] < stage_of[node]:
                    raise PlanError(f"node {node.name} ({node.meta.get(meta.MODULE)}) on stage "
                                    f"{stage_of[node]} feeds {user.name} on earlier stage {stage_of[user]}")
                if user.op != "output" and (node in recompute or _static_scalar(node)):
                    continue  # the reading stage makes it again, or reads it as a constant
                if node not in consumers:
                    consumers[node] = set()
                    outputs[stage_of[node]].append(node)
                if user.op != "output":
                    consumers[node].add(stage_of[user])
    out_index = {n: i for s in range(n_stages) for i, n in enumerate(outputs[s])}

    tied: dict[str, list[int]] = {}
    stages: list[StageSpec] = []
    for s in range(n_stages):
        g = torch.fx.Graph()
        root = torch.nn.Module()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[ValueRef] = []
        input_grad: list[bool] = []
        params: list[str] = []
        buffers: list[str] = []

        def bring(a: torch.fx.Node) -> torch.fx.Node:
            if a in env:
                return env[a]
            if a.op == "placeholder":
                b = binding[a.name]
                if b.kind == "user":
                    new = g.placeholder(a.name)
                    inputs.append(ValueRef(None, b.index))
                    input_grad.append(False)
                else:
                    target = b.target if b.kind != "constant" else "_const_" + b.target.replace(".", "_")
                    value = program.tensor(b.target) if b.kind != "constant" else program.constants[b.target]
                    set_nested(root, target, value)
                    (params if b.kind == "parameter" else buffers if b.kind == "buffer" else []).append(b.target)
                    new = g.get_attr(target)
            elif a.op == "get_attr":  # a higher-order op's body
                set_nested(root, a.target, getattr(program.gm, a.target))
                new = g.get_attr(a.target)
            elif _static_scalar(a):  # a Python scalar the trace knew: a constant in this stage
                env[a] = a.meta[meta.VAL]
                return env[a]
            elif a in recompute:  # copy the nodes it is made from into this stage
                for b in a.all_input_nodes:
                    bring(b)
                env[a] = g.node_copy(a, lambda x: env[x])
                return env[a]
            else:
                producer = stage_of[a]
                new = g.placeholder(a.name)
                inputs.append(ValueRef(producer, out_index[a]))
                input_grad.append(a in grad)
            new.meta = {k: v for k, v in a.meta.items() if k != meta.COST}  # its cost is the producer's
            env[a] = new
            return new

        for node in nodes[bounds[s]:bounds[s + 1]]:
            for a in node.all_input_nodes:
                bring(a)
            env[node] = g.node_copy(node, lambda a: env[a])
        g.output(tuple(env[n] for n in outputs[s]))
        gm = graph_module(root, g)
        final = {}
        for j, pos in enumerate(user_positions):
            arg = flat_outputs[pos]
            if isinstance(arg, torch.fx.Node) and stage_of.get(arg) == s:
                final[j] = out_index[arg]
        for fqn in params:
            tied.setdefault(fqn, []).append(s)
        stages.append(StageSpec(
            index=s, rank=stage_to_rank[s], first_module="" if s == 0 else cuts[s - 1][0], gm=gm,
            inputs=inputs, input_needs_grad=input_grad, outputs=[n.name for n in outputs[s]],
            output_needs_grad=[n in grad for n in outputs[s]],
            consumers=[sorted(consumers[n]) for n in outputs[s]], final=final, params=params, buffers=buffers))

    loss_output = loss_position(program)
    return PipelineProgram(stages=stages, stage_to_rank=list(stage_to_rank),
                           num_user_inputs=sum(1 for b in program.inputs if b.kind == "user"),
                           num_user_outputs=len(user_positions), loss_output=loss_output,
                           tied={k: v for k, v in tied.items() if len(v) > 1}, cuts=list(cuts))


def loss_position(program: Program) -> int | None:
    """Position of ``loss`` among the flattened user outputs of an HF ModelOutput, if any."""
    spec = program.out_spec
    keys = spec.context if isinstance(spec.context, list) else None
    if keys and "loss" in keys:
        index = 0
        for key, child in zip(keys, spec.children()):
            if key == "loss":
                return index
            index += child.num_leaves
    return None
