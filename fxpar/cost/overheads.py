"""fxpar's own per-step costs around the ops: what the runtime spends on one rank beside the kernels the roofline
prices and the collectives' alpha-beta. Pure functions of a :class:`~fxpar.cost.profiles.DeviceProfile` and the
counts of one rank's step (:class:`StepCounts`); seconds out (:class:`Overheads`).

Reads the profile fields ``fxpar calibrate`` measures on the runtime's own code paths
(:mod:`fxpar.runtime.calibrate_runtime`); a field left at 0 (not measured, as on the published GPU profiles)
prices nothing:

* ``collective_call[kind] = (a, b)``: one call of fxpar's collective op (dispatch, the copy of its input or
  output, the wait) beyond the raw torch.distributed collective: ``a`` per call plus ``b`` per full-tensor byte;
  the expert-parallel ops' kinds (``ep_counts``, ``ep_dispatch``, ``ep_combine``: per byte of their rows) are
  priced with their all-to-alls (:func:`fxpar.cost.experts.ep_comm`);
* ``pipeline_action[schedule]``: the pipeline runtime's bookkeeping per action a rank runs (forward, backward,
  input- or weight-gradient of one microbatch on one stage), beyond the action's compute and its sends;
* ``bucket_copy = (fixed, bw)``: per DP bucket (gradient hooks, launch, the gradients' views) and its
  gradients' copy into the bucket;
* ``gather_copy = (fixed, bw)``: per ZeRO-3 parameter gather (the op's copies of the shard and the bucket);
* ``optimizer_tensor = (per tensor, per group)``: the optimizer's fixed cost per stepped tensor and per
  parameter group, beyond ``optimizer_entry_time`` per entry;
* ``comm_share[k]``: a collective's speed when ``k`` ranks of the node compute at once (gloo reduces and copies
  on the cores the ranks compute on): the collectives' priced time is divided by it.

The runtime's terms are Python and copies on the rank's own core: where ``busy_ranks`` share a node's cores they
are divided by ``profile.share(busy_ranks)``, as the compute is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fxpar.ir.resolved import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from fxpar.cost.profiles import DeviceProfile

__all__ = ["Overheads", "StepCounts", "call_time", "comm_share", "dp_bucket_count", "gather_copy_time", "overheads",
           "runtime_fields"]


@dataclass(frozen=True)
class StepCounts:
    """What one rank runs in one training step beside the ops the roofline prices."""
    collectives: dict[str, tuple[int, float]] = field(default_factory=dict)  # kind -> (calls, full-tensor bytes in all)
    schedule: str = ""  # the pipeline schedule ("": not pipelined)
    actions: int = 0  # pipeline actions this rank runs per step
    dp_buckets: int = 0  # DP buckets reduced per step (DDP / ZeRO-1/2)
    dp_bucket_bytes: float = 0.0  # their gradient bytes, all buckets
    zero3_gathers: int = 0  # ZeRO-3 parameter gathers per step (forward and backward regathers)
    zero3_gather_bytes: float = 0.0  # their gathered (full) bytes, all gathers
    optimizer_tensors: int = 0  # tensors the optimizer steps (ZeRO-1/2: one flat shard per bucket)
    optimizer_groups: int = 0  # its parameter groups
    busy_ranks: float = 1.0  # ranks of this rank's node computing at once
    comm_time: float = 0.0  # seconds of this rank's collectives as priced by the alpha-beta tables


@dataclass(frozen=True)
class Overheads:
    """Seconds per term for one rank's step; :attr:`total` their sum."""
    collective_calls: float = 0.0
    pipeline: float = 0.0
    dp_buckets: float = 0.0
    zero3_gathers: float = 0.0
    optimizer: float = 0.0
    contention: float = 0.0

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))


def _per(fixed: float, bw: float, count: float, nbytes: float) -> float:
    return count * fixed + (nbytes / bw if bw else 0.0)


def call_time(profile: DeviceProfile, kind: str, nbytes: float) -> float:
    """One call of fxpar's ``kind`` collective op beyond the raw collective, unshared seconds (0: not measured)."""
    a, b = profile.collective_call.get(kind, (0.0, 0.0))
    return a + b * nbytes if a or b else 0.0


def gather_copy_time(profile: DeviceProfile, nbytes: float) -> float:
    """One ZeRO-3 gather's copies beyond its all-gather, unshared seconds (0: not measured)."""
    fixed, bw = profile.gather_copy
    return fixed + (nbytes / bw if bw else 0.0) if fixed or bw else 0.0


def dp_bucket_count(nbytes: float, first: float = 2**20, size: float = DEFAULT_BUCKET_BYTES) -> int:
    """Buckets the data-parallel engine makes of ``nbytes`` of gradients (runtime/data_parallel.py: a small
    first bucket, so that the first all-reduce starts early, then buckets of ``size``)."""
    if nbytes <= 0:
        return 0
    return 1 + (max(0, int(-(-(nbytes - first) // size))) if nbytes > first else 0)


def collective_calls_time(profile: DeviceProfile, counts: StepCounts) -> float:
    """fxpar's collective ops beyond the raw collectives, unshared seconds."""
    total = 0.0
    for kind, (calls, nbytes) in counts.collectives.items():
        a, b = profile.collective_call.get(kind, (0.0, 0.0))
        total += calls * a + nbytes * b
    return total


def pipeline_time(profile: DeviceProfile, counts: StepCounts) -> float:
    """The pipeline runtime's bookkeeping, unshared seconds: the rank's actions x the schedule's cost per action."""
    return counts.actions * profile.pipeline_action.get(counts.schedule, 0.0) if counts.schedule else 0.0


def comm_share(profile: DeviceProfile, busy_ranks: float, group: int | None = None) -> float:
    """A collective's speed factor on a group of ``group`` ranks while ``busy_ranks`` compute on its node:
    ``comm_share`` read by the rule :meth:`DeviceProfile.share` reads ``compute_share`` with (at most 1:
    ranks computing beside a collective can only slow it; a measured factor above 1 is noise), and where
    collectives run on the computing cores (``comm_overlaps`` False: gloo on a CPU host) no more than the
    compute's share with ``busy_ranks`` busy over its share with the group's own ranks busy (the calibration
    timed each group size with its ranks alone running: a collective's reductions and copies are work on
    those cores like any other, slowed by the ranks outside the group; ``group`` None: the measured factor
    alone). 1.0 where neither says otherwise, and where the group holds every busy rank."""
    if group is not None and busy_ranks <= group:
        # no rank outside the group computes beside it: the calibration timed this group size with its ranks
        # alone running, which is this case (a measured factor here is what ranks of the same group do to
        # each other's collectives, already in the group's alpha-beta; between two calibrations on this host
        # it read 1.26 and 0.20 for 8 of 8 ranks)
        return 1.0
    measured = 1.0
    if profile.comm_share:
        measured = min(1.0, dataclasses.replace(profile, compute_share=profile.comm_share).share(round(busy_ranks)))
    if group is not None and not profile.comm_overlaps and busy_ranks > group:
        own = profile.share(min(group, profile.ranks_per_node))
        return min(measured, profile.share(round(busy_ranks)) / own if own else 1.0)
    return measured


def overheads(profile: DeviceProfile, counts: StepCounts) -> Overheads:
    """Seconds per term of fxpar's own costs in one rank's step (module docstring)."""
    share = profile.share(round(counts.busy_ranks)) if counts.busy_ranks > 1 else 1.0
    return Overheads(
        collective_calls=collective_calls_time(profile, counts) / share,
        pipeline=pipeline_time(profile, counts) / share,
        dp_buckets=_per(*profile.bucket_copy, counts.dp_buckets, counts.dp_bucket_bytes) / share,
        zero3_gathers=_per(*profile.gather_copy, counts.zero3_gathers, counts.zero3_gather_bytes) / share,
        optimizer=(counts.optimizer_tensors * profile.optimizer_tensor[0]
                   + counts.optimizer_groups * profile.optimizer_tensor[1]) / share,
        contention=counts.comm_time * (1 / comm_share(profile, counts.busy_ranks) - 1))


def runtime_fields(r: dict) -> dict:
    """The :class:`DeviceProfile` fields of these terms from ``fxpar calibrate``'s ``"runtime"`` measurements
    (:func:`fxpar.runtime.calibrate_runtime.runtime_measurements`); absent ones are left out (0)."""
    out: dict = {}
    if r.get("collective_call"):
        out["collective_call"] = {k: (float(a), float(b)) for k, (a, b) in r["collective_call"].items()}
    if r.get("pipeline_action"):
        out["pipeline_action"] = {k: float(v) for k, v in r["pipeline_action"].items()}
    for key in ("bucket_copy", "gather_copy", "optimizer_tensor"):
        if r.get(key):
            out[key] = tuple(float(x) for x in r[key])
    if r.get("comm_share"):
        out["comm_share"] = {int(k): float(v) for k, v in r["comm_share"].items()}
    if "gather_scratch" in r:
        out["gather_scratch"] = float(r["gather_scratch"])
    return out
