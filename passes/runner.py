"""The pass runner: names, times, lints and dumps each pass, and says which pass failed after which.

A pass is a named function with the condition under which it runs (:class:`Pass`). Program passes take
and return a :class:`~fxpar.ir.program.Program`; the split turns it into a
:class:`~fxpar.ir.stage.PipelineProgram`; stage passes take and return one
:class:`~fxpar.ir.stage.StageSpec` and run on each stage this rank executes (pass-major: every stage
goes through one pass before the next pass starts). Side results (the TP layout, ZeRO-3 buckets) go
into ``ctx.out``.

What the runner adds around every pass, as torch.fx's ``PassManager`` does:

- ``graph.lint()`` after the pass, on each graph it returned;
- the time it took (``ctx.out.timings``, shown by ``fxpar plan`` and ``fxpar inspect``);
- a failure that is not already an :class:`~fxpar.ir.errors.FxparError` is re-raised as
  :class:`PassError` naming the pass and the passes that ran before it;
- ``FXPAR_DUMP_DIR=dir``: each graph before and after each pass, as ``dir/NN-<pass>.before.txt`` /
  ``.after.txt`` (stage passes: ``NN-<pass>.stage<i>.before.txt``);
- ``FXPAR_DISABLE_PASSES=a,b``: skip those passes by name (for bisecting a miscompile; the program
  is then no longer equal to one process unless the pass had nothing to do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxpar.ir.errors import FxparError, PassError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.options import run_options
from fxpar.ir.placement import TpResult
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.ir.stage import PipelineProgram, StageSpec


@dataclass
class PassOutputs:
    """What passes produce besides graphs; read by the runtime, the cost model and inspection."""

    tp: TpResult = field(default_factory=TpResult)  # what the TP pass sharded (empty without TP)
    zero3_buckets: dict[int, list] = field(default_factory=dict)  # stage -> its ZeRO-3 buckets
    timings: list[tuple[str, float]] = field(default_factory=list)  # (pass, seconds) in the order run
    fused_losses: list[str] = field(default_factory=list)  # loss nodes the fused_loss pass rewrote
    stage_fns: dict[int, Callable] = field(default_factory=dict)  # stage -> its compiled callable (inductor pass)


@dataclass
class PassContext:
    """Everything a pass may read: the plan, the mesh, this rank's coordinates, policies as callbacks.

    ``shared`` holds tensors every signature of one compiled model must share (this rank's TP shards,
    ZeRO-3 flat shards, weights loaded from ``load``), so a training and an inference trace of the same
    model update the same parameters.
    """

    plan: Plan
    mesh: MeshSpec
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cuts: list[tuple[str, str]] | None = None
    stage_to_rank: list[int] | None = None
    load: Callable | None = None  # (fqns, layout, like) -> this rank's tensor; a meta model's weights
    # (fqns, layout, like, start, end) -> entries [start, end) of it, flat: a ZeRO-3 shard's part of it
    load_flat: Callable | None = None
    traced_on_meta: bool = False
    param_group: Callable | None = None  # FQN -> its optimizer parameter group (ZeRO-3 buckets never mix)
    # (gm, stage index) -> a callable running it through Inductor, fxpar's collectives lowered for it
    # (``fxpar.runtime.compile.compile_stage``: it needs this rank's process groups); None: never compiled
    compile_stage: Callable | None = None
    shared: dict = field(default_factory=dict)
    # FXPAR_DISABLE_PASSES and FXPAR_DUMP_DIR (fxpar.ir.options) unless given
    disabled: frozenset[str] = field(default_factory=lambda: run_options().disabled_passes)
    dump_dir: Path | None = field(default_factory=lambda: run_options().dump_dir)
    program: Program | None = None  # set by the runner: the program being compiled (after TP)
    pipeline: PipelineProgram | None = None  # set by the runner after the split
    out: PassOutputs = field(default_factory=PassOutputs)

    def group(self, axis: str) -> str:
        """The name of this rank's group along ``axis`` (``"tp:0,1"``): what collectives in graphs carry."""
        return self.mesh.group_name(axis)

    @property
    def my_stages(self) -> list[StageSpec]:
        return self.pipeline.stages_of(self.mesh.pp_rank) if self.pipeline is not None else []


@dataclass(frozen=True)
class Pass:
    """One compiler pass: ``fn(obj, ctx) -> obj`` where ``when(ctx)`` holds. ``check(obj, ctx)``, its
    precondition (a PlanError naming the module and the fix where the traced program does not meet it), runs
    before ``fn`` and, through :func:`check`, on the first trace before any rank communicates."""

    name: str
    fn: Callable
    when: Callable[[PassContext], bool] = lambda ctx: True
    check: Callable | None = None


def _graph_of(obj) -> torch.fx.Graph | None:
    if isinstance(obj, (Program, StageSpec)):
        return obj.gm.graph
    if isinstance(obj, torch.fx.GraphModule):
        return obj.graph
    return None


class Runner:
    """Runs pass lists over one program for one rank, keeping the names of the passes done."""

    def __init__(self, ctx: PassContext):
        self.ctx = ctx
        self.done: list[str] = []

    def _dump(self, p: Pass, when: str, obj, suffix: str = "") -> None:
        if self.ctx.dump_dir is None:
            return
        if isinstance(obj, PipelineProgram):
            text = "\n\n".join(f"# stage {s.index} (pp rank {s.rank})\n{s.gm.code}" for s in obj.stages)
        else:
            g = _graph_of(obj)
            text = str(g) if g is not None else repr(obj)
        self.ctx.dump_dir.mkdir(parents=True, exist_ok=True)
        name = f"{len(self.done) + 1:02d}-{p.name}{suffix}.{when}.txt"
        (self.ctx.dump_dir / name).write_text(text)

    def runs(self, p: Pass) -> bool:
        return p.name not in self.ctx.disabled and bool(p.when(self.ctx))

    def apply(self, p: Pass, obj, suffix: str = ""):
        """Run one pass on one object (lint, time, dump, error context); the pass's result."""
        self._dump(p, "before", obj, suffix)
        start = time.perf_counter()
        if p.check is not None:
            p.check(obj, self.ctx)  # a PlanError: already names the module, the numbers and the fix
        try:
            result = p.fn(obj, self.ctx)
            stages = result.stages if isinstance(result, PipelineProgram) else []
            for g in [s.gm.graph for s in stages] or [_graph_of(result)]:
                if g is not None:
                    g.lint()  # what the pass returned is a well-formed graph
        except FxparError:
            raise  # already names the module, the numbers and the fix
        except Exception as e:
            raise PassError(f"an error occurred when running the {p.name!r} pass after the passes "
                            f"{self.done or 'none'}: {type(e).__name__}: {e}", pass_name=p.name,
                            done=list(self.done)) from e
        self._dump(p, "after", result, suffix)
        return result, time.perf_counter() - start

    def check(self, passes, obj) -> None:
        """The preconditions of ``passes`` that would run, on ``obj``, without running any pass."""
        for p in passes:
            if p.check is not None and self.runs(p):
                p.check(obj, self.ctx)

    def run(self, passes, obj):
        """Program passes (or the split): each in turn on ``obj``."""
        for p in passes:
            if self.runs(p):
                obj, secs = self.apply(p, obj)
                self.done.append(p.name)
                self.ctx.out.timings.append((p.name, secs))
        return obj

    def run_stages(self, passes, stages: list[StageSpec]) -> None:
        """Stage passes, pass-major over ``stages`` (results replace nothing: stages change in place)."""
        for p in passes:
            if not self.runs(p):
                continue
            total = 0.0
            for s in stages:
                result, secs = self.apply(p, s, suffix=f".stage{s.index}")
                if result is not s:
                    raise PassError(f"stage pass {p.name!r} must return the stage it was given",
                                    pass_name=p.name, done=list(self.done))
                total += secs
            self.done.append(p.name)
            self.ctx.out.timings.append((p.name, total))
