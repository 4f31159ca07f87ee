"""The default frontend: ``torch.export.export(..., strict=False)``.

Produces an ATen-level ``ExportedProgram`` (parameters and buffers lifted to placeholders, every
call_function node carrying ``nn_module_stack``); :mod:`fxpar.frontend.lower` turns it into a
:class:`~fxpar.ir.program.Program`.

``dynamic``: ``False`` traces static shapes; ``True`` marks dim 0 of every tensor input as the shared
symbol ``batch`` and dim 1 of every integer (token-like) 2-D+ tensor input as ``seq``; a dict is passed
to torch.export as ``dynamic_shapes`` unchanged.

User ``torch.autograd.Function`` calls stay one opaque node each, so the program runs their own
backward (:mod:`fxpar.frontend.functions`).

``stack_traces``: keep torch.export's ``stack_trace`` (the user source line) on every node. Off by
default: fxpar identifies nodes by module (``nn_module_stack``), and collecting and symbolising a
Python traceback per node is about a tenth of the capture time of a large model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.fx.config
from torch.export import Dim
from torch.utils import _pytree as pytree

from fxpar.frontend.data_reads import data_as_detach
from fxpar.frontend.diagnose import explain
from fxpar.frontend.expert_loops import expert_hit_loops
from fxpar.frontend.functions import keep_function_backwards
from fxpar.frontend.meta_constants import constants_with_values

_MAX = 1 << 20


def dynamic_shapes_by_name(values: dict[str, Any], dynamic: bool | dict | tuple | None):
    """torch.export ``dynamic_shapes`` for forward's arguments given by name (both frontends' rule).

    False/None: static. True: dim 0 of every tensor is the shared ``batch``, dim 1 of every integer
    tensor of rank >= 2 the shared ``seq``. A dict or tuple goes to torch.export unchanged.
    """
    if dynamic is None or dynamic is False:
        return None
    if dynamic is not True:
        return dynamic
    batch, seq = Dim("batch", min=1, max=_MAX), Dim("seq", min=1, max=_MAX)

    def spec(v: Any):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return None
        dims = {0: batch}
        if v.dim() >= 2 and not v.is_floating_point():
            dims[1] = seq
        return dims

    return {k: spec(v) for k, v in values.items()}


def capture_export(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None,
                   *, dynamic: bool | dict | None = False,
                   stack_traces: bool = False) -> torch.export.ExportedProgram:
    example_kwargs = dict(example_kwargs or {})
    shapes = dynamic_shapes_by_name({**_by_parameter_name(model, tuple(example_args)), **example_kwargs}, dynamic)
    # torch < 2.12 has no switch for the stack traces export records (it always records them)
    saved = getattr(torch.fx.config, "do_not_emit_stack_traces", None)
    if saved is not None:
        torch.fx.config.do_not_emit_stack_traces = not stack_traces
    try:
        # user autograd.Functions keep their own backward; loops over the experts a batch hit run over all;
        # a parameter updated in place through .data keeps the update; no distribution checks its arguments;
        # a constant built from Python data on meta keeps its values
        on_meta = any(t.is_meta for t in pytree.tree_leaves((example_args, example_kwargs))
                      if isinstance(t, torch.Tensor))
        with keep_function_backwards(), expert_hit_loops(), data_as_detach(), distribution_checks_off(), \
                (constants_with_values() if on_meta else contextlib.nullcontext()):
            return torch.export.export(model, tuple(example_args), example_kwargs, dynamic_shapes=shapes,
                                       strict=False)
    except Exception as exc:  # every capture failure becomes one clear TraceError
        raise explain(model, exc, "export") from exc
    finally:
        if saved is not None:
            torch.fx.config.do_not_emit_stack_traces = saved


@contextlib.contextmanager
def distribution_checks_off():
    """``torch.distributions`` without argument validation while capturing.

    A distribution built in forward (``Categorical(logits=...).entropy()``) checks its arguments with a
    Python ``if not constraint.check(value).all(): raise``: a branch on data, which export cannot trace
    (``GuardOnDataDependentSymNode: Eq(u0, 1)``). The check never changes a number (it raises on invalid
    values or passes), so the program is captured without it; eager calls still check."""
    saved = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(saved)


def _by_parameter_name(model: torch.nn.Module, example_args: tuple) -> dict[str, Any]:
    """Positional example args keyed by the names forward() gives them."""
    import inspect

    names = [n for n, p in inspect.signature(model.forward).parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return dict(zip(names, example_args))
