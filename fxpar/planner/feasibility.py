"""Every check that must pass before any rank communicates, as pure functions of the plan, the world,
the example batch and the optimizer. ``fxpar.compile`` calls them in this order; ``fxpar plan`` and a
planner call the same ones to explain why a plan cannot run.

Each raises :class:`~fxpar.ir.errors.PlanError` naming the numbers and the fix.
"""

from __future__ import annotations

import os
import warnings

import torch

from fxpar.ir.batch import traced_batch
from fxpar.ir.errors import PlanError
from fxpar.ir.optim import ParamGroups, check_optimizer, make_optimizer
from fxpar.ir.plan import Plan
from fxpar.ir.resolved import Resolved

PipelineSetup = Resolved  # how a plan runs its pipeline for one global batch (``Plan.resolve``)


def check_world(plan: Plan, world: int) -> None:
    """The plan's degrees must multiply to the world size; the message says how this process was started."""
    if plan.world_size == world:
        return
    need = plan.world_size
    launched = os.environ.get("WORLD_SIZE")
    if world == 1 and not launched:
        how = (f"this process was not started by torchrun (no WORLD_SIZE) and no process group exists; run it "
               f"with torchrun --nproc_per_node {need} (fxpar.compile joins the group itself)")
    elif launched and int(launched) != world:
        how = (f"torchrun started {launched} ranks but the process group has {world}; create no group of your "
               f"own, or one over the whole world")
    else:
        how = f"launch with torchrun --nproc_per_node {need} or change the degrees"
    ep = f" x ep={plan.ep}" if plan.ep > 1 else ""
    cp = f" x cp={plan.cp}" if plan.cp > 1 else ""
    raise PlanError(f"plan dp={plan.dp}{ep} x pp={plan.pp}{cp} x tp={plan.tp} needs {need} ranks, but the world has "
                    f"{world}: {how}", values={"ranks needed": need, "world": world})


def check_optimizer_factory(plan: Plan, optimizer, groups: ParamGroups | None = None) -> None:
    """Data parallelism and parameter groups need the optimizer; ZeRO refuses one it cannot shard. The
    factory is tried on dummies: one parameter, or with ``groups`` one per group in torch's group form."""
    if (plan.replicas > 1 or plan.zero) and optimizer is None:
        raise PlanError("data parallelism and ZeRO need the optimizer: pass optimizer=lambda params: ...")
    if groups is not None and optimizer is None:
        raise PlanError("fxpar.compile: param_groups sorts the parameters into the optimizer's groups, but no "
                        "optimizer was given: pass optimizer=lambda groups: torch.optim.AdamW(groups, ...)")
    if (plan.zero or groups is not None) and optimizer is not None:
        dummies = [torch.nn.Parameter(torch.zeros(1)) for _ in range(len(groups) if groups else 1)]
        opt = make_optimizer(optimizer, dummies, groups, range(len(dummies)))
        if plan.zero:
            check_optimizer(opt, plan.zero)


def warn_zero_with_pipeline(plan: Plan) -> None:
    if plan.zero >= 2 and plan.pp > 1:
        cost = ("gathers every parameter bucket again for each microbatch's forward and backward" if plan.zero == 3
                else "holds full gradients while the microbatches accumulate (its saving starts after the last)")
        warnings.warn(f"ZeRO-{plan.zero} with pipeline parallelism {cost}; ZeRO-1 is the usual choice with "
                      "pp > 1", stacklevel=4)


def pipeline_setup(plan: Plan, batch: int) -> Resolved:
    """Schedule, stage count and microbatches for a global ``batch``; checks that they fit together
    (:meth:`Plan.resolve` for the plan's own world)."""
    return plan.resolve(plan.world_size, batch)


def check_program(program, model, setup: PipelineSetup) -> None:
    """A program given to compile must be a trace of this model on one microbatch."""
    per, dp = setup.microbatch_size, setup.dp
    if program.root is not model or traced_batch(program) != per:
        raise PlanError(f"the program passed to compile must be fxpar.trace of this model on one microbatch "
                        f"({per} of the batch of {setup.batch}: {setup.microbatches} microbatches "
                        f"x dp={dp}); it was traced on {traced_batch(program)}")


def check_meta_constants(program, plan: Plan) -> None:
    """A program traced on the meta device (a meta-built model, or ZeRO-3 of a built one: it takes the model's
    tensors) has the values of the constants its forward builds from Python data (the frontend builds them on
    the CPU: ``fxpar.frontend.meta_constants``), but not of a tensor it reads that is neither a parameter nor a
    buffer (a plain tensor attribute of a module built on meta: never written, nothing ``weights=`` fills):
    running it would compute with values it never had, so such a program is a PlanError naming them."""
    lost = sorted(k for k, v in program.constants.items() if isinstance(v, torch.Tensor) and v.is_meta)
    if lost:
        how = ("ZeRO-3 took the model's tensors and traced it on meta" if plan.zero == 3
               else "the model is on the meta device")
        raise PlanError(f"{type(program.root).__name__} traced on the meta device ({how}) builds {len(lost)} "
                        f"constant tensors without values ({', '.join(lost[:4])}): tensors its forward reads that "
                        "are neither parameters nor buffers (a plain tensor attribute of a module built on meta), "
                        "which weights= cannot fill. Register them as buffers (register_buffer), or compile the "
                        "model built on the CPU under a plan without zero=3 (zero=1 shards the optimizer state)")


def check_split_points(cuts: list, plan: Plan, n_stages: int) -> None:
    if len(cuts) != n_stages - 1:
        raise PlanError(f"{len(cuts)} split points make {len(cuts) + 1} stages, but the plan "
                        f"has pp={plan.pp} x {n_stages // plan.pp} stages per rank = "
                        f"{n_stages}; give {n_stages - 1} split points")


def check_zero3_ties(plan: Plan, tied_across_ranks: list[str]) -> None:
    if plan.zero == 3 and tied_across_ranks:
        raise PlanError(f"ZeRO-3 shards each stage's parameters on their own, so weights tied across pipeline "
                        f"ranks ({tied_across_ranks}) would drift apart; use zero=1 or 2 with "
                        "this plan, or place the tied layers on one pipeline rank")


def tied_across_ranks(pipeline, stage_to_rank) -> list[str]:
    """Canonical FQNs of parameters held by stages on different pipeline ranks (sorted)."""
    return [fqn for fqn, stages in sorted(pipeline.tied.items()) if len({stage_to_rank[s] for s in stages}) > 1]


def tied_parameters(model: torch.nn.Module | None) -> list[list[str]]:
    """The FQNs of each parameter the model holds under several names (tied embeddings and LM heads)."""
    names: dict[int, list[str]] = {}
    for fqn, param in (model.named_parameters(remove_duplicate=False) if model is not None else ()):
        names.setdefault(id(param), []).append(fqn)
    return [fqns for fqns in names.values() if len(fqns) > 1]


def compile_rule(model: torch.nn.Module | None):
    """What ``fxpar.compile`` refuses that the costs cannot see, as the search's ``allow`` rule (plan -> None,
    or why not): ZeRO-3 with pp > 1 on a model with tied weights (ZeRO-3 shards each stage's parameters on
    their own, so tied weights on two pipeline ranks would drift apart: ``feasibility.check_zero3_ties``), and
    selective recompute under a schedule that splits the backward (the recompute pass refuses it)."""
    from fxpar.ir.schedule import normalize_schedule
    from fxpar.passes.recompute import SPLIT_BACKWARD

    tied = tied_parameters(model)
    names = " = ".join(tied[0]) if tied else ""

    def allow(plan: Plan) -> str | None:
        if tied and plan.zero == 3 and plan.pp > 1:
            return f"ZeRO-3 with pp={plan.pp} and tied weights ({names}) that pipeline ranks may share"
        if plan.recompute == "selective" and normalize_schedule(plan.schedule) in SPLIT_BACKWARD:
            return f"recompute='selective' with {plan.schedule}, whose backward runs in two passes"
        return None

    return allow
