"""The compile/runtime seam: what a compiled model's builder gives the runtime, declared here so the
runtime depends on this interface and never on ``fxpar.api`` or a builder's private names.

``fxpar.api`` implements :class:`Build` (one builder per ``fxpar.compile``); ``fxpar.runtime.model``,
``fxpar.runtime.programs`` and ``fxpar.runtime.generate`` read only what it declares. The builder runs
the whole pass list per signature, Inductor included (its ``inductor`` pass leaves the compiled stage
callables in :attr:`~fxpar.ir.stage.CompileResult.stage_fns`), so the runtime lowers and compiles
nothing itself.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from fxpar.ir.stage import CompileResult


@runtime_checkable
class Build(Protocol):
    """Compiles one input signature for one rank and answers the runtime's questions about the plan.

    Reads the model, plan, mesh and weights it was made with; writes nothing the runtime sees but the
    :class:`CompileResult` each call returns (tensors every signature shares stay inside the builder)."""

    setup: Any  # the example batch's pipeline set-up (fxpar.planner.feasibility.PipelineSetup)
    cuts: list[tuple[str, str]] | None  # the pipeline cuts, chosen on the first signature (None before it)

    def __call__(self, flat: list, spec, setup, program=None) -> CompileResult:
        """The flat inputs ``flat`` (pytree ``spec``) of a global batch cut as ``setup`` says, compiled:
        traced on one microbatch (or ``program``, the given trace), every pass of the list run."""

    def setup_for(self, batch: int):
        """The pipeline set-up for a global ``batch``; a PlanError before any communication."""

    @property
    def ep(self):
        """What the expert-parallel pass cut (:class:`~fxpar.ir.expert_ops.EpResult`), None without it or
        before the first signature."""

    def static_cache(self, batch: int, max_len: int):
        """The generation cache hook: a static KV cache the model traces with (``rows x max_len``), or
        None where the model has none (``CompiledModel.generate`` then re-runs the whole window)."""

    def estimate(self):
        """The plan priced by the cost model for the example batch (the Estimate the planner ranks);
        raises a PlanError where it cannot be priced."""

    def predict_memory(self, trainable: int, states: int, frozen: int = 0) -> dict:
        """Bytes a rank holding ``trainable`` parameter entries needs for its parameters, gradients and
        ``states`` fp32 optimizer states per entry, under the plan's ZeRO stage; ``frozen`` entries more
        (``requires_grad=False``) hold their weights alone."""
