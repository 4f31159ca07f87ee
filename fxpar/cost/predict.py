"""Predictions for a split program: per-stage times and bytes, the schedule's step time and bubble,
and the memory a rank holds for parameters, gradients and optimizer states.

Pure functions of the program, the plan and a device model; the compile wiring calls them, and so can
a planner pricing plans it never builds.
"""

from __future__ import annotations

from fxpar.cost.device import DeviceModel
from fxpar.cost.partition import candidate_modules, cut_positions, stage_costs
from fxpar.ir.schedule import simulate
from fxpar.ir.stage import PipelineProgram


def annotate_stages(traced, pipeline: PipelineProgram, cuts, device: DeviceModel, actions,
                    stage_to_rank: list[int]) -> dict:
    """Fill each stage's predicted times and boundary bytes; the schedule's predicted step and bubble."""
    units = cut_positions(traced, candidate_modules(traced))
    for spec, cost in zip(pipeline.stages, stage_costs(traced, cuts, device)):
        spec.fwd_time, spec.bwd_time, spec.transfer_time = cost.fwd, cost.bwd, cost.transfer
        spec.modules = [m for pos, m in units.items() if cost.start <= pos < cost.end]
        spec.recv_bytes, spec.send_bytes = cost.recv_bytes, cost.send_bytes
    f = [s.fwd_time for s in pipeline.stages]
    b = [s.bwd_time for s in pipeline.stages]
    comm = max((device.transfer_time(s.send_bytes) for s in pipeline.stages), default=0.0)
    sim = simulate(actions, stage_to_rank, {"F": f, "B": b, "I": [x / 2 for x in b], "W": [x / 2 for x in b]},
                   comm=comm)
    return {"step_time": sim.makespan, "bubble": sim.bubble, "device": device.name}


def memory_per_rank(numel: int, zero: int, dp: int, states: int) -> dict[str, int]:
    """Bytes one rank holds between steps for ``numel`` trainable fp32 parameter entries of its stages:
    ZeRO-1/2 add an fp32 master shard; ZeRO-2 keeps gradient shards only (plus full gradients of the
    step in flight, not counted); ZeRO-3 keeps shards of everything; ``states`` optimizer states per entry."""
    n = numel
    return {"params": 4 * n // dp if zero == 3 else 4 * n + (4 * n // dp if zero in (1, 2) else 0),
            "grads": 4 * n // dp if zero >= 2 else 4 * n + (4 * n // dp if zero == 1 else 0),
            "optimizer": 4 * states * n // (dp if zero >= 1 else 1)}
