"""Lower an ``ExportedProgram`` (from either frontend) into fxpar's :class:`Program`.

Reads ``ep.graph_signature``, ``ep.call_spec``, node ``nn_module_stack``. Writes node meta
``fxpar.module`` on every node (subgraphs of higher-order ops included) and ``fxpar.param`` on
parameter/buffer placeholders.

Tied parameters: torch.export gives each FQN of a tied tensor its own placeholder (both fed the same
tensor). Here they become one placeholder under the canonical FQN, so that every later pass sees one
parameter used in several places.
"""

from __future__ import annotations

import re

import torch
from torch.export.graph_signature import InputKind, OutputKind

from fxpar.frontend.hf import read_model_info, tensor_groups
from fxpar.ir import meta
from fxpar.ir.errors import TraceError
from fxpar.ir.program import InputBinding, OutputBinding, ParamInfo, Program, subgraphs_of

_CALL_SUFFIX = re.compile(r"@\d+$")  # repeated calls of one module: "model.norm@1"


def _module_resolver(model: torch.nn.Module):
    names = {name for name, _ in model.named_modules(remove_duplicate=False)}

    def resolve(path: str) -> str:
        path = _CALL_SUFFIX.sub("", path)
        while path and path not in names:  # unknown segment (e.g. a slice of a ModuleList): back off
            path = path.rpartition(".")[0]
        return path

    return resolve


def _innermost(node: torch.fx.Node, resolve) -> str | None:
    stack = node.meta.get(meta.NN_MODULE_STACK)
    if not stack:
        return None
    path, _cls = list(stack.values())[-1]
    return resolve(path)


def annotate_modules(gm: torch.fx.GraphModule, resolve, default: str = "") -> None:
    """Write ``fxpar.module`` on every node; nodes without a stack inherit from their first input."""
    for node in gm.graph.nodes:
        if meta.MODULE in node.meta:
            continue
        owner = _innermost(node, resolve)
        if owner is None:
            inputs = [a for a in node.all_input_nodes if a.op != "placeholder"]
            owner = inputs[0].meta.get(meta.MODULE, default) if inputs else default
        node.meta[meta.MODULE] = owner
        for sub in subgraphs_of(gm, node):
            annotate_modules(sub, resolve, owner)


def _name_subgraphs_by_target(gm: torch.fx.GraphModule) -> None:
    """Each ``get_attr`` of a subgraph named ``graph_<target>``: export may name ``submod_1``'s node
    ``submod_3``, ``torch.export.load`` names it ``submod_1``; one rule makes a program loaded from the
    program cache print as the traced one."""
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            node._rename(f"graph_{node.target}")


def program_from_exported(ep: torch.export.ExportedProgram, model: torch.nn.Module, *,
                          frontend: str) -> Program:
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise TraceError(f"graph has {len(placeholders)} placeholders but its signature {len(sig.input_specs)}",
                         frontend=frontend)

    canonical: dict[str, str] = {}
    params: dict[str, ParamInfo] = {}
    tensors: dict[str, torch.Tensor] = {}
    for is_buffer, fqns, t in tensor_groups(model):
        params[fqns[0]] = ParamInfo(fqns[0], tuple(t.shape), t.dtype, bool(t.requires_grad), is_buffer,
                                    tuple(fqns[1:]))
        tensors[fqns[0]] = t
        for f in fqns:
            canonical[f] = fqns[0]

    resolve = _module_resolver(model)
    inputs: list[InputBinding] = []
    seen: dict[str, torch.fx.Node] = {}
    constants: dict[str, object] = {}
    n_user = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if spec.target not in canonical:
                raise TraceError(f"exported placeholder {node.name} is bound to {spec.target!r}, which is "
                                 "not a parameter or buffer of the model", frontend=frontend)
            fqn = canonical[spec.target]
            if fqn in seen:  # a tied alias: use the canonical placeholder instead
                node.replace_all_uses_with(seen[fqn])
                gm.graph.erase_node(node)
                continue
            seen[fqn] = node
            node.meta[meta.PARAM] = fqn
            node.meta[meta.MODULE] = params[fqn].module
            inputs.append(InputBinding("buffer" if params[fqn].is_buffer else "parameter", node.name, fqn))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            constants[spec.target] = ep.constants[spec.target]
            node.meta[meta.MODULE] = resolve(spec.target.rpartition(".")[0])
            inputs.append(InputBinding("constant", node.name, spec.target))
        elif spec.kind == InputKind.USER_INPUT:
            node.meta[meta.MODULE] = ""
            inputs.append(InputBinding("user", node.name, index=n_user))
            n_user += 1
        else:
            raise TraceError(f"unsupported graph input kind {spec.kind.name} for {node.name}",
                             frontend=frontend, hint="the model uses side effects fxpar cannot bind yet")

    outputs: list[OutputBinding] = []
    for spec in sig.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(OutputBinding("user"))
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(OutputBinding("buffer_mutation", canonical[spec.target]))
        else:
            raise TraceError(f"unsupported graph output kind {spec.kind.name}", frontend=frontend,
                             hint="the model mutates its inputs; clone them inside forward or report it")

    annotate_modules(gm, resolve)
    _name_subgraphs_by_target(gm)
    gm.graph.lint()
    gm.recompile()
    return Program(gm, inputs=inputs, outputs=outputs, in_spec=ep.call_spec.in_spec,
                   out_spec=ep.call_spec.out_spec, params=params, tensors=tensors, constants=constants,
                   info=read_model_info(model), frontend=frontend, root=model)

