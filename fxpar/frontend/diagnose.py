"""Turn a capture failure into a :class:`TraceError` that names the module, the operation and the fix.

The module is found from the failing traceback: the innermost frame whose ``self`` is a submodule of
the traced model. The operation is the model-code line that was running there. The fix comes from a
small table of known failure shapes (cache objects in outputs, data-dependent control flow, missing
arguments, specialised dynamic dimensions).
"""

from __future__ import annotations

import linecache
import re
import traceback
import types

import torch

from fxpar.ir.errors import TraceError

# (pattern on "ExceptionType: message", hint). First match wins.
_HINTS: tuple[tuple[str, str], ...] = (
    (r"Cache|past_key_values",
     "the model returns a KV-cache object: fxpar turns the config's use_cache off for a trace given no "
     "past_key_values unless the call passes use_cache=True; drop use_cache=True, or pass use_cache=False "
     "in example_kwargs (and when calling)"),
    (r"data.dependent|GuardOnDataDependent|Could not guard on|Could not extract specialized integer",
     "the model branches on tensor values here; pass that value as a Python constant, or make the input "
     "static (dynamic=False)"),
    (r"missing \d+ required positional argument|missing a required argument",
     "pass every required argument of forward() in example_args/example_kwargs"),
    (r"unexpected keyword argument",
     "example_kwargs names an argument forward() does not take; drop it"),
    (r"Constraints violated|specializ|not in range|Received user-specified dim hint",
     "a dimension you asked to be dynamic is fixed by the model; trace with dynamic=False or only the "
     "dims the model keeps symbolic"),
    (r"co_varnames is too small|symbolically traced variables cannot be used as inputs to control flow",
     "this transformers version's HFTracer cannot trace the model; use frontend='export'"),
)


def _module_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def _frames(tb: types.TracebackType | None):
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next


def locate(model: torch.nn.Module, exc: BaseException) -> tuple[str | None, str | None]:
    """(innermost module FQN, "file:line: source") of the model code running when ``exc`` was raised."""
    names = _module_names(model)
    module, where = None, None
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:  # follow __cause__ / __context__ too
        seen.add(id(chain))
        for frame, lineno in _frames(chain.__traceback__):
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in names:
                module = names[id(owner)]
                src = linecache.getline(frame.f_code.co_filename, lineno).strip()
                where = f"{frame.f_code.co_filename}:{lineno}: {src}"
        if module is not None:
            break
        chain = chain.__cause__ or chain.__context__
    return module, where


def hint_for(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    for pattern, hint in _HINTS:
        if re.search(pattern, text):
            return hint
    return ("no known fix for this failure; try the other frontend (frontend='export' or 'hf_fx'), and "
            "check that forward() runs eagerly with the same arguments")


def explain(model: torch.nn.Module, exc: BaseException, frontend: str) -> TraceError:
    module, where = locate(model, exc)
    first_line = (str(exc).strip().splitlines() or [""])[0]
    op = where or "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
    err = TraceError(
        f"could not trace {type(model).__name__}: {type(exc).__name__}: {first_line[:400]}",
        module=module if module is not None else "", op=op, hint=hint_for(exc), frontend=frontend)
    return err
