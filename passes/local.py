"""One rank's program from a rewritten graph: its slices of the parameters bound, every ``val`` redone.

Reads: the traced :class:`Program`, the rewritten graph, a function that cuts a full tensor to this
rank's part. Writes: a new :class:`Program` (the traced one is left as it was) whose parameters are
this rank's slices and whose nodes carry FakeTensor values of the local shapes. The tensor-parallel
and expert-parallel passes both end here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.ir import meta
from fxpar.ir.program import ParamInfo, Program


def bind_local(program: Program, gm: torch.fx.GraphModule, shards: dict[str, torch.Tensor],
               cut: Callable[[str, torch.Tensor], torch.Tensor | None]) -> Program:
    """``program`` with graph ``gm`` and, for each parameter ``cut`` returns a slice of, that slice as a
    fresh Parameter (kept in ``shards`` by FQN: a later signature of the same model binds the same
    tensors again instead of slicing anew); shapes refreshed."""
    tensors, params = {}, {}
    for fqn, info in program.params.items():
        t = program.tensor(fqn)
        if fqn not in shards:
            piece = cut(fqn, t.detach())
            if piece is not None:
                shards[fqn] = torch.nn.Parameter(piece, requires_grad=t.requires_grad) \
                    if isinstance(t, torch.nn.Parameter) else piece
        if fqn in shards:
            t = shards[fqn]
            info = ParamInfo(info.fqn, tuple(t.shape), info.dtype, info.requires_grad, info.is_buffer, info.aliases)
        tensors[fqn], params[fqn] = t, info
    local = Program(gm, inputs=program.inputs, outputs=program.outputs, in_spec=program.in_spec,
                    out_spec=program.out_spec, params=params, tensors=tensors, constants=program.constants,
                    info=program.info, frontend=program.frontend, root=program.root)
    refresh_vals(local)
    return local


def refresh_vals(program: Program) -> None:
    """Recompute every node's ``val`` with local shapes (FakeTensorProp over the rewritten graph). The
    collectives' fake kernels read their group's size from its name (or its registration). Parameters
    stay static; sizes read from data (tokens per expert, ``.tolist()``) become unbacked symbols."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    phs = [n for n in program.gm.graph.nodes if n.op == "placeholder"]
    bound = {b.placeholder: b for b in program.inputs}
    fakes = []
    users = [n.meta.get(meta.VAL) for n in phs if bound[n.name].kind == "user"]
    device = next((v.device for v in users if isinstance(v, torch.Tensor)), None)
    for n in phs:
        b = bound[n.name]
        if b.kind in ("parameter", "buffer"):
            t = program.tensor(b.target).detach()
            # a meta-traced program may already hold some real shards: shapes are what matter here
            fakes.append(mode.from_tensor(t.to(device) if device is not None and t.device != device else t))
        else:
            v = n.meta.get(meta.VAL)
            if isinstance(v, torch.Tensor):
                with mode:
                    v = torch.empty(v.shape, dtype=v.dtype, device=v.device)
            fakes.append(v)
    FakeTensorProp(program.gm, mode).propagate_dont_convert_inputs(*fakes)
