"""Errors fxpar raises. Each message names the module, the numbers and the fix."""

from __future__ import annotations


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose."""


class TraceError(FxparError):
    """The model could not be captured into a graph.

    ``module`` is the FQN of the innermost module being traced when it failed ("" for the root),
    ``op`` the operation or Python construct that failed, ``hint`` what to do about it.
    """

    def __init__(self, message: str, *, module: str | None = None, op: str | None = None,
                 hint: str | None = None, frontend: str | None = None):
        self.module = module
        self.op = op
        self.hint = hint
        self.frontend = frontend
        parts = [message]
        if frontend:
            parts.append(f"frontend: {frontend}")
        if module is not None:
            parts.append(f"module: {module or '<root>'}")
        if op:
            parts.append(f"operation: {op}")
        if hint:
            parts.append(f"fix: {hint}")
        super().__init__("\n  ".join(parts))


class PlanError(FxparError):
    """A plan that cannot be carried out on this model or world (raised before any communication)."""
