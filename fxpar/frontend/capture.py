"""One entry to the frontends: capture a model with the frontend asked for, or ``"auto"`` (torch.export,
then transformers' HFTracer where export fails and the installed transformers has it), lowered into
fxpar's IR. ``fxpar.trace`` and the planner's trace of a shortened copy both call :func:`capture_program`.

With ``FXPAR_PROGRAM_CACHE`` set, an export-frontend capture is kept on disk and a later run with an
unchanged model, inputs and versions loads it instead of tracing (:mod:`fxpar.frontend.program_cache`).

Either frontend traces with the model's KV cache off unless the call asks for it
(:mod:`fxpar.frontend.kv_cache`): a stock config's ``use_cache=True`` needs no ``use_cache=False`` from
the caller, at trace time or at any later call of the compiled program.
"""

from __future__ import annotations

import torch

from fxpar.frontend import program_cache
from fxpar.frontend.export import capture_export
from fxpar.frontend.kv_cache import cache_off_for_trace, call_values
from fxpar.frontend.lower import program_from_exported
from fxpar.ir.errors import TraceError
from fxpar.ir.options import run_options
from fxpar.ir.program import Program

FRONTENDS = ("auto", "export", "hf_fx")

__all__ = ["FRONTENDS", "capture_program"]


def _capture(model, example_args, example_kwargs, frontend: str, dynamic, stack_traces: bool):
    if frontend == "export":
        return capture_export(model, example_args, example_kwargs, dynamic=dynamic, stack_traces=stack_traces)
    from fxpar.frontend import hf_fx

    if not hf_fx.available():
        raise TraceError("the hf_fx frontend is not available", frontend="hf_fx",
                         hint=hf_fx.unavailable_reason())
    return hf_fx.capture_hf_fx(model, example_args, example_kwargs,
                               dynamic_shapes=None if not dynamic else dynamic)


def capture_program(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None, *,
                    frontend: str = "auto", dynamic: bool | dict = False, stack_traces: bool = False) -> Program:
    """The model captured by ``frontend`` and lowered (no costs yet: ``fxpar.cost.flops.annotate_costs``).
    Under ``"auto"`` an export failure is re-raised when HFTracer is missing or fails too."""
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend={frontend!r}; choose one of {FRONTENDS}")
    example_args = tuple(example_args)
    example_kwargs = dict(example_kwargs or {})
    directory = run_options().program_cache  # FXPAR_PROGRAM_CACHE: a program traced in an earlier run
    name = None
    if directory is not None and program_cache.cacheable(frontend, dynamic):
        name = program_cache.key(model, example_args, example_kwargs, frontend=frontend, dynamic=dynamic,
                                 stack_traces=stack_traces)
    if name is None:
        ep, used = _capture_with_fallback(model, example_args, example_kwargs, frontend, dynamic, stack_traces)
    else:
        with program_cache.turn(directory, name):  # a host's ranks: one traces, the others load its file
            ep, used = program_cache.load(directory, name), "export"
            if ep is None:
                ep, used = _capture_with_fallback(model, example_args, example_kwargs, frontend, dynamic,
                                                  stack_traces)
                if used == "export":
                    program_cache.save(directory, name, ep)
    return program_from_exported(ep, model, frontend=used)


def _capture_with_fallback(model, example_args, example_kwargs, frontend: str, dynamic, stack_traces: bool):
    """(ExportedProgram, the frontend that made it), traced with the model's KV cache off."""
    with cache_off_for_trace(model, call_values(model, example_args, example_kwargs)):
        return _capture_either(model, example_args, example_kwargs, frontend, dynamic, stack_traces)


def _capture_either(model, example_args, example_kwargs, frontend: str, dynamic, stack_traces: bool):
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
    return ep, used
