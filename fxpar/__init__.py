"""fxpar: compile an unmodified PyTorch / Hugging Face model into a distributed program.

The public face (re-exports only): :func:`trace`, :func:`compile`, :func:`autoplan`, :func:`price` (the
Estimate of one plan, as the planner ranks it), :func:`inspect`, :class:`Plan`, :class:`Program`.
"""

from fxpar.api import compile, trace
from fxpar.ir.errors import FxparError, PlanError, TraceError
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.planner.auto import autoplan, price
from fxpar.report.report import inspect
from fxpar.runtime.model import CompiledModel

__all__ = ["trace", "compile", "autoplan", "price", "inspect", "Plan", "Program", "CompiledModel", "FxparError",
           "TraceError", "PlanError"]
__version__ = "0.1.0"
