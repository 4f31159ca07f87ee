"""The second frontend: ``transformers.utils.fx`` (HFTracer), lowered into the same IR as ``export``.

HFTracer exists only in transformers < 5, and traces most decoders only before 4.48
(:mod:`fxpar.frontend.hf_fx_support` loads it). :func:`capture_hf_fx` runs it, then lowers the
torch-level fx graph to ATen with ``torch.export.export(..., strict=False)``, so the result is an
``ExportedProgram`` of the same kind the ``export`` frontend gives:

* parameters and buffers are lifted under the model's own FQNs with their original persistence: the
  exported GraphModule holds the model's own child modules, so every parameter is there, used or not,
  and a tied weight gets one placeholder per FQN, both fed the same tensor;
* every ``call_function`` / ``get_attr`` node carries ``nn_module_stack`` in torch.export's format:
  HFTracer's per-node stacks survive the lowering (``preserve_node_meta``); the root entry, missing
  because the exported root is a GraphModule, is added afterwards with the model's class;
* inputs keep the call's structure (``ep.module()(**example_kwargs)`` works); non-tensor values are
  baked into the trace (HFTracer ``concrete_args``), so the graph is only valid for those values;
* outputs have the model's own ``ModelOutput`` type, rebuilt from HFTracer's plain dict by a final node.

What differs from ``export``: the graph is HFTracer's (equivalent but different ATen ops;
``model.training`` baked at trace time); stateless modules created inside ``forward``
(``nn.CrossEntropyLoss()``) appear as submodules ``crossentropyloss_0`` of the exported root, and
tensor constants built from Python data as ``ep.constants`` entries ``_tensor_constant<N>``. Capture
facts are in ``ep.graph_module.meta["fxpar.hf_fx"]``. Failures become
:class:`~fxpar.ir.errors.TraceError` with ``frontend="hf_fx"``, ``module`` the innermost module being
traced, ``op`` the model-code line that failed, and a hint ending in "use frontend='export'".
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from fxpar.frontend.diagnose import locate
from fxpar.frontend.export import dynamic_shapes_by_name
from fxpar.frontend.hf_fx_support import FRONTEND, load, tracer_class, transformers_version, version_tuple
from fxpar.frontend.kv_cache import cache_off_for_trace
from fxpar.ir.errors import TraceError

META_KEY = "fxpar.hf_fx"
_ROOT_KEY = "L__self__"  # torch.export's key for the root entry of nn_module_stack
_CONSTANT_TYPES = (type(None), bool, int, float, str)


# --------------------------------------------------------------------------------------------------
# availability (HFTracer is loaded by hf_fx_support)

def available() -> bool:
    """Whether the installed transformers has ``transformers.utils.fx`` (HFTracer)."""
    return load()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return load()[1]


# --------------------------------------------------------------------------------------------------
# errors

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    cls = type(exc)
    name = cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return f"{name}: {text[0][:300] if text else ''}"


def _trace_error(model: torch.nn.Module, exc: BaseException, module: str | None) -> TraceError:
    version = transformers_version()
    text = f"{type(exc).__name__}: {exc}"
    if version_tuple(version) >= (4, 48):
        hint = (f"HFTracer in transformers {version} cannot trace most models (it works on 4.47 and "
                "before); install transformers<4.48 or use frontend='export'")
    elif "symbolically traced variables cannot be used as inputs to control flow" in text:
        hint = ("the model branches in Python on a value HFTracer only knows symbolically, which fx "
                "symbolic tracing cannot follow; use frontend='export'")
    elif "Proxy object cannot be iterated" in text:
        hint = ("the model iterates over or unpacks a value HFTracer only knows symbolically, which fx "
                "symbolic tracing cannot follow; use frontend='export'")
    else:
        hint = "HFTracer cannot trace this model's code; use frontend='export'"
    return TraceError(
        f"HFTracer (transformers {version}) could not trace {type(model).__name__}: {_first_line(exc)}",
        module=module if module is not None else "", op=locate(model, exc)[1] or _first_line(exc),
        hint=hint, frontend=FRONTEND)


def _lowering_error(model: torch.nn.Module, exc: BaseException) -> TraceError:
    """A failure of torch.export on HFTracer's graph: name the fx node (and its module) that failed."""
    node = None
    chain: BaseException | None = exc
    seen: set[int] = set()
    while chain is not None and id(chain) not in seen and node is None:
        seen.add(id(chain))
        tb = chain.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if frame.f_code.co_name == "run_node" and isinstance(frame.f_locals.get("n"), torch.fx.Node):
                node = frame.f_locals["n"]
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    module, op = "", locate(model, exc)[1] or _first_line(exc)
    if node is not None:
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            module = list(stack.values())[-1][0]
        op = f"{node.format_node()}"
    text = f"{type(exc).__name__}: {exc}"
    details = [ln.strip() for ln in str(exc).splitlines() if ln.strip().startswith("- ")][:3]
    message = (f"torch.export could not lower HFTracer's graph of {type(model).__name__} to ATen: "
               f"{_first_line(exc)}")
    if details:
        message += " " + " ".join(details)
    if re.search(r"Constraints violated|specializ|not in range|Received user-specified dim hint", text):
        hint = ("a dimension asked to be dynamic is constrained by the model's code (see above); capture "
                "with static shapes or make only the dims the model keeps symbolic dynamic")
    else:
        hint = "the fx graph HFTracer produced is not exportable here; use frontend='export'"
    return TraceError(message, module=module, op=op, hint=hint, frontend=FRONTEND)


# --------------------------------------------------------------------------------------------------
# capture

def _bind(model: torch.nn.Module, example_args: tuple, example_kwargs: dict) -> tuple[list[str], dict]:
    """Names of the positional example args, and {name: value} of every given argument."""
    sig = inspect.signature(model.forward)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(example_args) > len(positional):
        raise TraceError(f"{type(model).__name__}.forward takes {len(positional)} positional arguments "
                         f"but {len(example_args)} example_args were given", frontend=FRONTEND,
                         module="", op="forward()", hint="pass the extra inputs by name in example_kwargs")
    arg_names = [p.name for p in positional[:len(example_args)]]
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    values = dict(zip(arg_names, example_args))
    for k, v in example_kwargs.items():
        if k in values:
            raise TraceError(f"argument {k!r} given both in example_args and example_kwargs",
                             frontend=FRONTEND, module="", op="forward()", hint=f"pass {k!r} once")
        if k not in named:
            raise TraceError(f"{type(model).__name__}.forward has no named parameter {k!r}; HFTracer can "
                             "only feed named parameters of forward()", frontend=FRONTEND, module="",
                             op="forward()", hint=f"drop {k!r}, or use frontend='export'")
        values[k] = v
    for k, v in values.items():
        if not isinstance(v, (torch.Tensor, *_CONSTANT_TYPES)):
            raise TraceError(f"argument {k!r} is a {type(v).__name__}; the hf_fx frontend takes tensors "
                             "and plain Python constants (None, bool, int, float, str) only",
                             frontend=FRONTEND, module="", op=f"forward({k}=...)",
                             hint="pass it as a tensor, leave it out, or use frontend='export'")
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in values:
            continue
        if p.default is inspect.Parameter.empty:
            raise TraceError(f"{type(model).__name__}.forward needs argument {p.name!r}", frontend=FRONTEND,
                             module="", op="forward()",
                             hint="pass every required argument of forward() in example_args/example_kwargs")
    return arg_names, values


def _trace(model: torch.nn.Module, values: dict) -> tuple[torch.fx.Graph, Any, bool]:
    """Run HFTracer: (graph, the tracer, whether the model is outside HFTracer's supported list)."""
    hf_fx_module, _ = load()
    tracer_cls = tracer_class()
    sig = inspect.signature(model.forward)
    inputs = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    concrete = {p.name: p.default for p in sig.parameters.values() if p.name not in inputs}
    concrete.update({k: v for k, v in values.items() if k not in inputs})
    # transformers' symbolic_trace(..., disable_check=False) refuses models outside its list, although
    # many of them trace; fxpar always traces and records that the check had to be skipped.
    try:
        needs_disable_check = not hf_fx_module.is_model_supported(model)
    except Exception:
        needs_disable_check = True
    tracer = tracer_cls()
    # as symbolic_trace does, but only for the duration of the trace (fxpar.frontend.kv_cache's rule)
    with cache_off_for_trace(model, values):
        try:
            graph = tracer.trace(model, concrete_args=concrete, dummy_inputs=inputs,
                                 complete_concrete_args_with_inputs_not_in_dummy_inputs=False)
        except TraceError:
            raise
        except Exception as exc:
            module = tracer.failed_module
            if module is None:
                stack = getattr(tracer, "module_stack", None)  # fx leaves it unpopped on failure
                module = next(reversed(stack.values()))[0] if stack else ""
            raise _trace_error(model, exc, module) from exc
    return graph, tracer, needs_disable_check


def _build_graph_module(model: torch.nn.Module, graph: torch.fx.Graph, before_attrs: set[str],
                        before_children: set[str]) -> tuple[torch.fx.GraphModule, list[str], list[str]]:
    """A GraphModule running ``graph`` whose module tree is the model's own.

    Returns it, the stateless modules HFTracer inserted, and the tensor constants the tracer added
    (both removed again from ``model``).
    """
    gm = torch.fx.GraphModule(model, graph)
    inserted = [n for n in model._modules if n not in before_children]
    constants = [n for n in vars(model) if n not in before_attrs and n not in ("_modules",)
                 and isinstance(vars(model)[n], torch.Tensor)]
    for name in inserted:  # HFTracer added them to the user's model: take them back out
        del model._modules[name]
    for name in constants:
        delattr(model, name)
    # The model's own tree instead of GraphModule's partial copies: every parameter and buffer (used by
    # the graph or not) under its original FQN, with its original persistence; tied weights stay tied.
    for name, child in model.named_children():
        gm.add_module(name, child)
    for name, p in model._parameters.items():
        if p is not None:
            gm.register_parameter(name, p)
    for name, b in model._buffers.items():
        if b is not None:
            gm.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
    # Tensor constants made by the tracer are constants, not buffers of the model.
    for name in constants:
        if name in gm._buffers:
            value = gm._buffers.pop(name)
            gm._non_persistent_buffers_set.discard(name)
            setattr(gm, name, value)
    return gm, inserted, constants


def _fix_inputs(graph: torch.fx.Graph, order: list[str]) -> None:
    """Placeholders exactly for ``order`` (the call's argument names), in that order."""
    existing = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    unknown = [t for t in existing if t not in order]
    if unknown:
        raise TraceError(f"HFTracer's graph takes inputs {unknown} that were not given", frontend=FRONTEND,
                         module="", op="placeholder")
    body = next(n for n in graph.nodes if n.op != "placeholder")
    for name in order:  # each one moved just before the first non-placeholder: ``order`` is kept
        node = existing.get(name)
        if node is None:  # a constant argument baked into the trace: accepted, unused
            with graph.inserting_before(body):
                node = graph.placeholder(name)
        body.prepend(node)


def _fix_output(graph: torch.fx.Graph, output_type: type | None) -> None:
    """Make the graph return the model's own output class instead of HFTracer's plain dict."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    value = out.args[0]
    if output_type is None or not isinstance(value, dict) or output_type is dict \
            or not issubclass(output_type, dict):
        return
    with graph.inserting_before(out):
        rebuilt = graph.call_function(output_type, (), dict(value))
    out.args = (rebuilt,)


def _root_entry(model: torch.nn.Module) -> tuple[str, str]:
    cls = type(model)
    return ("", f"{cls.__module__}.{cls.__qualname__}")


def _fix_module_stacks(ep: torch.export.ExportedProgram, model: torch.nn.Module,
                       inserted: list[str]) -> None:
    """Put the model's root entry first in every node's nn_module_stack (export's own layout).

    Entries of the stateless modules HFTracer inserted (``crossentropyloss_0``) are dropped: they are
    not part of the model, and torch.export on the model itself files their ops under the module whose
    forward called them -- which is then the innermost entry left.
    """
    root = _root_entry(model)

    def foreign(path: str) -> bool:
        return any(path == name or path.startswith(name + ".") for name in inserted)

    for gm in ep.graph_module.modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "get_attr"):
                continue
            stack = node.meta.get("nn_module_stack") or {}
            stack = {k: v for k, v in stack.items() if k != _ROOT_KEY and v[0] != "" and not foreign(v[0])}
            node.meta["nn_module_stack"] = {_ROOT_KEY: root, **stack}


def capture_hf_fx(model: torch.nn.Module, example_args: tuple = (), example_kwargs: dict | None = None,
                  *, dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    """Trace ``model`` with HFTracer and lower it to an ATen ``ExportedProgram`` (see the module doc).

    ``example_args`` / ``example_kwargs``: the call to capture; tensors become graph inputs, plain
    Python constants (``use_cache=False``) are baked in. ``dynamic_shapes``: None/False (static), True
    (batch and sequence dims symbolic, as in the ``export`` frontend) or torch.export's own spec.
    Works on meta-device models. Raises :class:`TraceError` (``frontend="hf_fx"``) on any failure.
    """
    if not available():
        raise TraceError("the hf_fx frontend is not available", frontend=FRONTEND, hint=unavailable_reason())
    example_args = tuple(example_args)
    example_kwargs = dict(example_kwargs or {})
    arg_names, values = _bind(model, example_args, example_kwargs)

    before_attrs, before_children = set(vars(model)), set(model._modules)
    graph, tracer, needs_disable_check = _trace(model, values)
    gm, inserted, constants = _build_graph_module(model, graph, before_attrs, before_children)
    _fix_inputs(gm.graph, arg_names + list(example_kwargs))
    _fix_output(gm.graph, tracer.output_type)
    gm.graph.lint()
    gm.recompile()
    gm.training = model.training  # the root flag only: .train() would reset the model's own submodules

    shapes = dynamic_shapes_by_name(values, dynamic_shapes)
    try:
        ep = torch.export.export(gm, example_args, example_kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:
        raise _lowering_error(model, exc) from exc
    _fix_module_stacks(ep, model, inserted)
    output_type = tracer.output_type
    ep.graph_module.meta[META_KEY] = {
        "transformers": transformers_version(),
        "disable_check": needs_disable_check,
        "output_type": (f"{output_type.__module__}.{output_type.__qualname__}" if output_type else None),
        "inserted_modules": inserted,
        "tensor_constants": constants,
    }
    return ep
