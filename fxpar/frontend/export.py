"""The default frontend: ``torch.export.export(..., strict=False)``.

Produces an ATen-level ``ExportedProgram`` (parameters and buffers lifted to placeholders, every
call_function node carrying ``nn_module_stack``); :mod:`fxpar.frontend.lower` turns it into a
:class:`~fxpar.ir.program.Program`.

``dynamic``: ``False`` traces static shapes; ``True`` marks dim 0 of every tensor input as the shared
symbol ``batch`` and dim 1 of every integer (token-like) 2-D+ tensor input as ``seq``; a dict is passed
to torch.export as ``dynamic_shapes`` unchanged.

``stack_traces``: keep torch.export's ``stack_trace`` (the user source line) on every node. Off by
default: fxpar identifies nodes by module (``nn_module_stack``), and collecting and symbolising a
Python traceback per node is about a tenth of the capture time of a large model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx.config
from torch.export import Dim

from fxpar.frontend.diagnose import explain

_MAX = 1 << 20


def dynamic_shapes_for(example_args: tuple, example_kwargs: dict, dynamic: bool | dict | None):
    if not dynamic:
        return None
    if isinstance(dynamic, dict):
        return dynamic
    batch, seq = Dim("batch", min=1, max=_MAX), Dim("seq", min=1, max=_MAX)

    def spec(v: Any):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return None
        dims = {0: batch}
        if v.dim() >= 2 and not v.is_floating_point():
            dims[1] = seq
        return dims

    return {**{k: spec(v) for k, v in example_kwargs.items()}} if not example_args else (
        tuple(spec(a) for a in example_args), {k: spec(v) for k, v in example_kwargs.items()})


def capture_export(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None,
                   *, dynamic: bool | dict | None = False,
                   stack_traces: bool = False) -> torch.export.ExportedProgram:
    example_kwargs = dict(example_kwargs or {})
    shapes = dynamic_shapes_for(tuple(example_args), example_kwargs, dynamic)
    if shapes is not None and example_args:
        # torch.export wants dynamic_shapes shaped like (args..., kwargs) flattened into forward's names
        args_shapes, kw_shapes = shapes
        shapes = _by_parameter_name(model, args_shapes, kw_shapes)
    saved = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = not stack_traces
    try:
        return torch.export.export(model, tuple(example_args), example_kwargs, dynamic_shapes=shapes,
                                   strict=False)
    except Exception as exc:  # every capture failure becomes one clear TraceError
        raise explain(model, exc, "export") from exc
    finally:
        torch.fx.config.do_not_emit_stack_traces = saved


def _by_parameter_name(model: torch.nn.Module, args_shapes: tuple, kw_shapes: dict) -> dict:
    import inspect

    names = [n for n, p in inspect.signature(model.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = dict(zip(names, args_shapes))
    out.update(kw_shapes)
    return out
