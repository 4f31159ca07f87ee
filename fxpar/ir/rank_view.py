"""What inspection reads of a compiled model on one rank: :class:`RankView`, a typed record.

``fxpar.report`` reads a compiled (or priced) model only through this record, never its attributes
(``m``, ``dp``, ``engine``...), so the runtime's classes can change shape without the report following.
The runtime fills it (``fxpar.runtime.view.rank_view``, offered as ``compiled.view()``); the report takes
either the record or any object with ``view()`` (:func:`view_of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fxpar.ir.mesh import MeshSpec
from fxpar.ir.plan import Plan
from fxpar.ir.program import Program
from fxpar.ir.stage import CompileResult, PipelineProgram, StageSpec


@dataclass(frozen=True)
class DpBucket:
    """One bucket of the data-parallel engine (DDP / ZeRO-1/2): how many parameters, the first one's
    FQN (in its stage), the bucket's bytes and this rank's shard's bytes (0 where it keeps no shard)."""

    params: int
    first: str
    bytes: int
    shard_bytes: int


@dataclass(frozen=True)
class DataParallelView:
    """The data-parallel engine of this rank: its buckets, the payload bytes per collective of the last
    step (zeros before one), and the fxpar kernels it launches per bucket."""

    buckets: tuple[DpBucket, ...] = ()
    comm: dict[str, int] = field(default_factory=dict)
    kernels: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankView:
    """A compiled model on this rank, as inspection reads it.

    ``result``: the training signature's compile result (program, pipeline, TP result, ZeRO-3 buckets);
    ``schedule``: the pipeline schedule's name, ``actions`` this rank's schedule actions, ``microbatches``
    per replica and step; ``data_parallel``: the engine's record (None without one: one replica and no
    ZeRO, or ZeRO-3, whose collectives are graph nodes); ``memory``: what ``compiled.memory()`` gives;
    ``estimate``: prices the plan on call (the cost model's Estimate; raises a PlanError where it has
    none), None for an object that has no price."""

    plan: Plan
    mesh: MeshSpec
    result: CompileResult
    cuts: list[tuple[str, str]]
    schedule: str
    actions: Any
    microbatches: int
    device: Any
    memory: dict[str, dict[str, int]]
    data_parallel: DataParallelView | None = None
    estimate: Callable[[], Any] | None = None

    @property
    def pp_rank(self) -> int:
        return self.mesh.pp_rank

    @property
    def replicas(self) -> int:
        """Data replicas (``dp x ep``): each its own slice of the batch."""
        return self.mesh.replicas

    @property
    def program(self) -> Program:
        return self.result.program

    @property
    def pipeline(self) -> PipelineProgram:
        return self.result.pipeline

    def my_stages(self) -> list[StageSpec]:
        """The pipeline stages this rank runs."""
        return self.result.pipeline.stages_of(self.mesh.pp_rank)


def view_of(obj) -> RankView:
    """``obj`` itself if it is a :class:`RankView`, else ``obj.view()`` (a compiled or priced model)."""
    return obj if isinstance(obj, RankView) else obj.view()
