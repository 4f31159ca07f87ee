"""``Resolved``: a :class:`~fxpar.ir.plan.Plan` for one world and one global batch, every default and
derived value filled in once (``Plan.resolve(world, batch)``), so that passes, runtime, cost and report read
the same numbers instead of deriving them again.

Reads: the plan, the world size and the global batch. Writes nothing. The rules that need only the plan
(:func:`dp_bucket_bytes`, :func:`zero3_bucket_bytes`, :func:`dp_axis`) and the microbatch size
(:func:`microbatch_size`) are module functions too, for the planner's pricer, which prices thousands of
plans and checks each in its own words before it asks.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxpar.ir import schedule as sched
from fxpar.ir.errors import PlanError

MB = 2**20
DEFAULT_BUCKET_MB = 25
"""The data-parallel gradient bucket when ``Plan.bucket_mb`` is None (torch DDP's default), and what
Inductor may merge ZeRO-3's gathers into."""
DEFAULT_BUCKET_BYTES = DEFAULT_BUCKET_MB * MB


def dp_bucket_bytes(plan) -> int:
    """DDP / ZeRO-1/2 gradient buckets: ``plan.bucket_mb`` MB, default :data:`DEFAULT_BUCKET_MB`."""
    return int((plan.bucket_mb or DEFAULT_BUCKET_MB) * MB)


def zero3_bucket_bytes(plan) -> int:
    """ZeRO-3 parameter buckets: ``plan.bucket_mb`` MB, default 0 (one bucket per layer)."""
    return int((plan.bucket_mb or 0) * MB)


def dp_axis(plan) -> str:
    """The name of the device mesh's data-parallel dimension: ``dp_shard`` under ZeRO, else ``dp_replicate``."""
    return "dp_shard" if plan.zero else "dp_replicate"


def microbatch_size(batch: int, replicas: int, microbatches: int) -> int:
    """Sequences per microbatch: the global ``batch`` over ``replicas`` data replicas (dp x ep) and
    ``microbatches`` per replica (the caller has checked that they divide it)."""
    return batch // (replicas * microbatches)


@dataclass(frozen=True)
class Resolved:
    """How a plan runs for one world and one global batch: defaults resolved, checked together."""

    schedule: str
    """The canonical schedule name."""
    n_stages: int
    """pp x stages per rank."""
    microbatches: int
    """Per data-parallel replica (the plan's, else one per stage)."""
    batch: int
    """The global batch."""
    dp: int
    """Data replicas, each with its own slice of the batch: dp x ep (expert parallelism is carved out of dp)."""
    stage_to_rank: tuple[int, ...]
    world: int = 1
    virtual_stages: int = 1
    """Stages per pipeline rank."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """DDP / ZeRO-1/2 gradient bucket (:func:`dp_bucket_bytes`)."""
    zero3_bucket_bytes: int = 0
    """ZeRO-3 parameter bucket; 0: one per layer (:func:`zero3_bucket_bytes`)."""
    dp_axis: str = "dp_replicate"
    """The device mesh's data-parallel dimension (:func:`dp_axis`)."""

    @property
    def replicas(self) -> int:
        return self.dp

    @property
    def microbatch_size(self) -> int:
        return microbatch_size(self.batch, self.dp, self.microbatches)


def resolve(plan, world: int, batch: int) -> Resolved:
    """``plan`` for ``world`` ranks and a global ``batch``: schedule, stage count, microbatches and their size,
    buckets and the dp axis. A PlanError when the degrees do not make ``world`` ranks, the batch does not
    divide into microbatches x replicas, or the schedule cannot run them."""
    if plan.world_size != world:
        raise PlanError(f"plan dp={plan.dp} x ep={plan.ep} x pp={plan.pp} x cp={plan.cp} x tp={plan.tp} needs "
                        f"{plan.world_size} ranks, but the world has {world}",
                        fix="change the degrees or the world size")
    name = sched.normalize_schedule(plan.schedule)
    v = sched.stages_per_rank(name, plan.virtual_stages)
    n_stages = plan.pp * v
    m = sched.microbatches(plan)
    dp = plan.replicas
    if batch % (m * dp):
        raise PlanError(f"batch of {batch} does not divide into {m} microbatches x dp={dp}; global batch = "
                        f"microbatch size x microbatches x dp: pick a batch that is a multiple of {m * dp} "
                        "(a data loader's last short batch: drop_last=True) or another number of microbatches")
    sched.validate(name, plan.pp, m, n_stages)
    return Resolved(name, n_stages, m, batch, dp, tuple(sched.stage_to_rank(name, plan.pp, n_stages)), world=world,
                    virtual_stages=v, bucket_bytes=dp_bucket_bytes(plan), zero3_bucket_bytes=zero3_bucket_bytes(plan),
                    dp_axis=dp_axis(plan))
