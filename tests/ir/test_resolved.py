"""``Plan.resolve(world, batch)``: every default and derived value once, read by the runtime, the cost model
and the planner; and the per-run records that replaced process-global counters."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from fxpar.cost import memory, overheads
from fxpar.ir.errors import PlanError
from fxpar.ir.plan import Plan
from fxpar.planner import feasibility
from fxpar.runtime import compile as rt_compile
from fxpar.runtime import expert_parallel
from fxpar.runtime.data_parallel import DataParallelEngine


def test_resolve_fills_every_default():
    r = Plan(dp=2, ep=2, pp=2, zero=1, schedule="interleaved_1f1b").resolve(8, 32)
    # 2 stages per rank by default for interleaved; microbatches default to the stage count (4); dp x ep replicas
    assert (r.schedule, r.virtual_stages, r.n_stages, r.microbatches, r.replicas) == ("interleaved_1f1b", 2, 4, 4, 4)
    assert r.microbatch_size == 32 // (4 * 4) == 2 and r.stage_to_rank == (0, 1, 0, 1) and r.world == 8
    assert (r.bucket_bytes, r.zero3_bucket_bytes, r.dp_axis) == (25 * 2**20, 0, "dp_shard")
    z3 = Plan(dp=2, zero=3, bucket_mb=2.5, microbatches=3).resolve(2, 6)
    assert (z3.bucket_bytes, z3.zero3_bucket_bytes, z3.microbatch_size) == (int(2.5 * 2**20),) * 2 + (1,)
    assert Plan(dp=2).resolve(2, 2).dp_axis == "dp_replicate"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.microbatches = 8
    with pytest.raises(PlanError, match="does not divide into 4 microbatches x dp=4"):
        Plan(dp=2, ep=2, pp=2, zero=1, schedule="interleaved_1f1b").resolve(8, 24)
    with pytest.raises(PlanError, match="needs 4 ranks, but the world has 2"):
        Plan(dp=2, pp=2).resolve(2, 8)
    # what compile runs on (feasibility's pipeline set-up) is the resolved plan
    assert feasibility.pipeline_setup(Plan(pp=2, microbatches=4), 8) == Plan(pp=2, microbatches=4).resolve(2, 8)


def test_one_bucket_default_everywhere():
    """The engine, the memory and overhead models and Inductor's ZeRO-3 cap all take the resolved default."""
    bucket = Plan().resolve(1, 1).bucket_bytes
    engine = inspect.signature(DataParallelEngine.__init__).parameters["bucket_bytes"].default
    counted = inspect.signature(overheads.dp_bucket_count).parameters["size"].default
    assert engine == memory.BUCKET == counted == rt_compile.ZERO3_BUCKET_CAP_MB * 2**20 == bucket


def test_expert_counters_belong_to_their_record():
    """Two compiled models' EP records count their own steps: a step of one inside the other's does not
    reset or join the other's loads (they were one process-global table)."""
    a, b = expert_parallel.ExpertParallelRecord(None, None), expert_parallel.ExpertParallelRecord(None, None)
    offs = torch.tensor([2, 5, 5, 6])  # cumulative tokens per expert: 2, 3, 0, 1
    a.start()
    torch.ops.fxpar.ep_counts(offs, "ep:0", "model.a")
    b.start()
    torch.ops.fxpar.ep_counts(offs, "ep:0", "model.b")
    b.finish()
    a.finish()
    assert list(a.stats) == ["model.a"] and list(b.stats) == ["model.b"]
    assert a.stats["model.a"]["tokens_per_expert"] == [2, 3, 0, 1]
