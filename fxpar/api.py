"""The public entry points; the one place that wires frontends, passes, cost model and inspection."""

from __future__ import annotations

import torch

from fxpar.cost.flops import annotate_costs
from fxpar.frontend.export import capture_export
from fxpar.frontend.lower import program_from_exported
from fxpar.ir.errors import TraceError
from fxpar.ir.program import Program

FRONTENDS = ("auto", "export", "hf_fx")


def _capture(model, example_args, example_kwargs, frontend: str, dynamic, stack_traces: bool):
    if frontend == "export":
        return capture_export(model, example_args, example_kwargs, dynamic=dynamic, stack_traces=stack_traces)
    from fxpar.frontend import hf_fx

    if not hf_fx.available():
        raise TraceError("the hf_fx frontend is not available", frontend="hf_fx",
                         hint=hf_fx.unavailable_reason())
    return hf_fx.capture_hf_fx(model, example_args, example_kwargs,
                               dynamic_shapes=None if not dynamic else dynamic)


def trace(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None, *,
          frontend: str = "auto", dynamic: bool | dict = False, stack_traces: bool = False) -> Program:
    """Capture ``model`` into fxpar's IR.

    ``frontend``: ``"export"`` (torch.export, non-strict), ``"hf_fx"`` (transformers.utils.fx, where the
    installed transformers has it) or ``"auto"`` (export, then hf_fx if export fails and hf_fx exists).
    ``dynamic``: ``True`` makes the batch dim and the sequence dim of token inputs symbolic.
    ``stack_traces``: keep the user source line on every node (``node.meta["stack_trace"]``, export
    frontend); off by default because it costs about a tenth of the capture time of a large model.

    The returned :class:`Program` is called like the model and returns what the model returns; every
    node carries its FakeTensor (``val``), owning module (``fxpar.module``) and cost (``fxpar.cost``).
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend={frontend!r}; choose one of {FRONTENDS}")
    example_args = tuple(example_args)
    example_kwargs = dict(example_kwargs or {})
    if frontend == "auto":
        try:
            ep, used = _capture(model, example_args, example_kwargs, "export", dynamic, stack_traces), "export"
        except TraceError as export_error:
            from fxpar.frontend import hf_fx

            if not hf_fx.available():
                raise
            try:
                ep, used = _capture(model, example_args, example_kwargs, "hf_fx", dynamic, stack_traces), "hf_fx"
            except TraceError:
                raise export_error from None
    else:
        ep, used = _capture(model, example_args, example_kwargs, frontend, dynamic, stack_traces), frontend
    program = program_from_exported(ep, model, frontend=used)
    annotate_costs(program)
    return program
