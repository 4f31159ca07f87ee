"""fxpar: compile an unmodified PyTorch / Hugging Face model into a distributed program.

The public face (re-exports only): :func:`trace`, :func:`inspect`, :class:`Program`.
"""

from fxpar.api import trace
from fxpar.inspect.report import inspect
from fxpar.ir.errors import FxparError, PlanError, TraceError
from fxpar.ir.program import Program

__all__ = ["trace", "inspect", "Program", "FxparError", "TraceError", "PlanError"]
__version__ = "0.1.0"
