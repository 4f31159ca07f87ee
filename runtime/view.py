"""``compiled.view()``: a compiled (or priced) model on this rank as the typed record inspection reads
(:class:`fxpar.ir.rank_view.RankView`), so ``fxpar.report`` never reaches into the runtime's classes.

Reads the model's plan, mesh, set-up, training signature's result, engine and builder; writes nothing.
"""

from __future__ import annotations

from fxpar.ir.rank_view import DataParallelView, DpBucket, RankView


def engine_view(engine) -> DataParallelView | None:
    """The data-parallel engine's buckets (bytes whole and of this rank's shard), its payload bytes of
    the last step and the kernels it launches; None without an engine."""
    if engine is None:
        return None
    buckets = tuple(DpBucket(len(b.names), b.names[0], b.shard_numel * b.dp * b.params[0].element_size(),
                             b.shard_numel * 4 if b.shard is not None else 0) for b in engine.buckets)
    return DataParallelView(buckets, dict(engine.comm), tuple(engine.kernels))


def rank_view(compiled) -> RankView:
    """The :class:`RankView` of ``compiled`` (a ``PricedPlan`` or ``CompiledModel``) as it is now."""
    mesh, setup = compiled.spec, compiled.setup  # this rank's coordinates; the batch's cut and schedule
    return RankView(plan=compiled.plan, mesh=mesh, result=compiled.result, cuts=compiled.cuts,
                    schedule=setup.schedule, actions=compiled.schedule[mesh.pp_rank],
                    microbatches=setup.microbatches, device=compiled.device, memory=compiled.memory(),
                    data_parallel=engine_view(compiled.engine), estimate=lambda: compiled.predicted)
