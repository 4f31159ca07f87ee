"""Errors fxpar raises. Each message names the module, the numbers and the fix.

Every class lives here, in the vocabulary layer, so that any layer can raise or catch any of them
without importing the layer that raises it (the CLI catches :class:`PlanError` from the planner and
:class:`CollectiveError` from the runtime alike).
"""

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
    """A plan that cannot be carried out on this model or world (raised before any communication).

    Optional, shaped like :class:`TraceError`: ``module`` the FQN the problem is about, ``values`` the
    numbers that disagree (e.g. ``{"heads": 6, "tp": 4}``), ``fix`` what to change. Each one given is
    appended to the message on its own line; with none given the message is exactly ``message``.
    """

    def __init__(self, message: str, *, module: str | None = None, values: dict | None = None,
                 fix: str | None = None):
        self.module = module
        self.values = values
        self.fix = fix
        parts = [message]
        if module is not None:
            parts.append(f"module: {module or '<root>'}")
        if values:
            parts.append("values: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("\n  ".join(parts))


class CollectiveError(FxparError):
    """A collective that cannot run (bad shapes, unknown group, not a member) or that failed or timed
    out. ``op`` is the fxpar op, ``group`` the group's name, ``sizes`` the shapes involved."""

    def __init__(self, message: str, *, op: str, group: str, sizes=None):
        self.op = op
        self.group = group
        self.sizes = sizes
        super().__init__(f"fxpar.{op} on group {group!r}: {message}")


class PipelineError(FxparError):
    """The pipeline runtime cannot go on: a message a rank waits for never comes (a peer failed or the
    schedules disagree), a message arrived that nothing reads, or a schedule left work undone. The
    message names this rank, the peer and the stage/microbatch involved."""


class PassError(FxparError):
    """A compiler pass failed with an error that is not already an :class:`FxparError`.

    ``pass_name`` is the failing pass, ``done`` the passes that ran before it, in order (the message
    says both, as torch.fx's ``PassManager`` does)."""

    def __init__(self, message: str, *, pass_name: str, done: list[str] | None = None):
        self.pass_name = pass_name
        self.done = list(done or [])
        super().__init__(message)


class ShardingWarning(UserWarning):
    """A tensor-parallel plan leaves a large part of the parameters whole on every rank where they could
    be cut (correct, but it saves no memory there): warned once per compile, naming the largest such
    modules and the ``tp_plan`` entry that would cut them (:mod:`fxpar.report.tp_coverage`)."""


class CheckpointError(FxparError):
    """A checkpoint that cannot be written or found: ``path`` is the file or directory involved, ``reason``
    the operating system's words for it ("No space left on device", "Permission denied") or what was
    expected there; the message also says what still holds (the checkpoint ``latest`` names) and the fix."""

    def __init__(self, message: str, *, path=None, reason: str | None = None):
        self.path = path
        self.reason = reason
        super().__init__(message)


class InputError(PlanError):
    """A file or name the user gave that cannot be read as given: a model argument, a weights file, a data
    file. ``path`` is what was given (the file, the row's file, the model argument); the message names
    what is wrong with it (the shard of N, the line, the field, the numbers) and the fix. A
    :class:`PlanError`, so that whoever catches plan errors before communicating catches these too."""

    def __init__(self, message: str, *, path=None, values: dict | None = None, fix: str | None = None):
        self.path = path
        super().__init__(message, values=values, fix=fix)


class OptionError(FxparError, ValueError):
    """An fxpar environment variable (:mod:`fxpar.ir.options`) holds a value it does not accept:
    ``variable`` is its name, ``value`` the text it held; the message says what it accepts."""

    def __init__(self, message: str, *, variable: str, value: str):
        self.variable = variable
        self.value = value
        super().__init__(message)
