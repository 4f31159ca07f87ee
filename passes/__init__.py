"""fxpar's compiler, top to bottom: the pass lists and :func:`run`.

A traced :class:`~fxpar.ir.program.Program` (the same on every rank) goes through the program passes,
is split into pipeline stages, and each stage this rank runs goes through the stage passes. A pass runs
where its condition holds; ``FXPAR_DISABLE_PASSES`` skips passes by name and ``FXPAR_DUMP_DIR`` writes
each graph before and after each pass (``passes/runner.py``).

Analyses are not passes: costs are annotated at trace time (``fxpar.cost.flops``), and the stage costs
and schedule predictions are computed from the split program by ``fxpar.cost.predict``.
"""

from __future__ import annotations

import warnings

import torch

from fxpar.ir.errors import PlanError
from fxpar.ir.program import Program
from fxpar.ir.resolved import zero3_bucket_bytes
from fxpar.ir.stage import PipelineProgram
from fxpar.passes import quantize_base as quantize_base_pass
from fxpar.passes.collective_matmul import collective_matmul
from fxpar.passes.context_parallel import check as context_parallel_check
from fxpar.passes.context_parallel import context_parallel
from fxpar.passes.drop_dtype_asserts import drop_dtype_asserts
from fxpar.passes.ep_loops import loop_regions
from fxpar.passes.expert_parallel import expert_parallel, expert_regions
from fxpar.passes.fused_loss import fuse_loss
from fxpar.passes.lower_collectives import lower_collectives
from fxpar.passes.materialize_weights import materialize_weights
from fxpar.passes.param_updates import needed as param_updates_needed
from fxpar.passes.param_updates import param_updates
from fxpar.passes.pipeline_split import loss_position, split_pipeline
from fxpar.passes.quantize_base import check as quantize_base_check
from fxpar.passes.quantize_base import quantize_base
from fxpar.passes.recompute import recompute
from fxpar.passes.retarget_device import retarget_device
from fxpar.passes.runner import Pass, PassContext, PassOutputs, Runner
from fxpar.passes.tensor_parallel import tensor_parallel
from fxpar.passes.zero3 import zero3

__all__ = ["PROGRAM_PASSES", "SPLIT", "STAGE_PASSES", "Pass", "PassContext", "PassOutputs", "check", "run"]


def _fused_loss(program: Program, ctx: PassContext) -> Program:
    program, fused = fuse_loss(program)
    ctx.out.fused_losses = fused
    losses = [n.name for n in program.graph.nodes if n.target == torch.ops.aten.cross_entropy_loss.default]
    if losses:  # a loss the pattern does not take (logits transformed or sliced before it)
        warnings.warn(f"Plan(fused_loss=True): the loss {losses} does not read an LM head's logits unchanged "
                      "(see fxpar/passes/fused_loss.py); it runs unfused, holding the logits", stacklevel=2)
    return program


def _tensor_parallel(program: Program, ctx: PassContext) -> Program:
    loss = loss_position(program)  # a training step never gathers the logits: only the loss is kept whole
    keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
    styles = ctx.plan.tp_plan if isinstance(ctx.plan.tp_plan, dict) else None
    program, ctx.out.tp = tensor_parallel(program, ctx.mesh.tp, ctx.mesh.tp_rank, styles, group=ctx.group("tp"),
                                          shards=ctx.shared.setdefault("tp_shards", {}), keep_outputs=keep,
                                          sequence_parallel=ctx.plan.sequence_parallel,
                                          replicate=ctx.plan.tp_replicate)
    return program


def _expert_parallel(program: Program, ctx: PassContext) -> Program:
    program, ctx.shared["ep"] = expert_parallel(program, ctx.mesh.ep, ctx.mesh.ep_rank, ctx.group("ep"),
                                                shards=ctx.shared.setdefault("ep_shards", {}))
    return program


def _expert_parallel_check(program: Program, ctx: PassContext) -> None:
    """The EP pass's precondition: expert regions whose expert count ep divides, in a materialised model."""
    if ctx.load is not None:
        raise PlanError(f"Plan(ep={ctx.mesh.ep}) does not take weights= yet (expert slices are cut from a "
                        "materialised model): build the model on a device (docs/expert_parallel.md)")
    if not expert_regions(program, ctx.mesh.ep):  # experts run as a loop over the experts
        loop_regions(program, ctx.mesh.ep)
        if ctx.mesh.cp > 1:
            raise PlanError(f"Plan(ep={ctx.mesh.ep}, cp={ctx.mesh.cp}): the experts run as a loop over the "
                            "experts, which expert parallelism splits without context parallelism only "
                            "(docs/expert_parallel.md)")


def _context_parallel(program: Program, ctx: PassContext) -> Program:
    loss = loss_position(program)  # the loss is summed over cp; other sharded outputs stay this rank's rows
    keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
    program, ctx.shared["cp"] = context_parallel(program, ctx.mesh.cp, ctx.mesh.cp_rank, ctx.group("cp"),
                                                 keep_outputs=keep, attention=ctx.plan.cp_attention)
    return program


def _split(program: Program, ctx: PassContext) -> PipelineProgram:
    return split_pipeline(program, ctx.cuts, ctx.stage_to_rank)


def _zero3(stage, ctx: PassContext):
    plan = ctx.plan
    mesh = ctx.mesh  # sharded over the shard group: all of dp, or with HSDP (dp_replicate > 1) dp / dp_replicate
    # QLoRA's codes and scales (buffers), sharded and gathered as held: never cast, never in a wire format
    held = quantize_base_pass.held_names(stage.gm, ctx) if plan.base_dtype is not None else []
    buckets = zero3(stage.gm, stage.params + held, mesh.dp_shard, mesh.dp_shard_rank, group=mesh.shard_group_name(),
                    bucket_bytes=zero3_bucket_bytes(plan), prefetch=plan.prefetch,
                    cache=ctx.shared.setdefault("zero3", {}),
                    group_of=ctx.param_group,
                    compute_dtype=torch.bfloat16 if plan.mixed_precision == "bf16" else None,
                    comm_dtype=f"{plan.comm_dtype}+grads" if plan.quantize_grads else plan.comm_dtype,
                    load_flat=_load_flat(ctx) if ctx.load_flat is not None else None, device=_shard_device(ctx),
                    held=frozenset(held))
    ctx.out.zero3_buckets.setdefault(stage.index, buckets)
    _release_sharded(ctx, [n for b in buckets for n in b.names if n not in held])
    quantize_base_pass.release(ctx, held)
    return stage


def _shard_device(ctx: PassContext) -> torch.device:
    """Where ZeRO-3 makes a meta parameter's shard: on the rank's device, read from the weights; in a priced
    build (``fxpar.api.price``: no Inductor, nothing runs) without weights, on the meta device: shapes only."""
    return torch.device("meta") if ctx.compile_stage is None and ctx.load_flat is None else ctx.device


def _inductor(stage, ctx: PassContext):
    """``Plan(compile=True)`` on this device: the stage's callable through ``torch.compile`` (Inductor compiles
    it on its first call), fxpar's collectives lowered to torch's functional collectives inside it."""
    ctx.out.stage_fns[stage.index] = ctx.compile_stage(stage.gm, stage=stage.index, lower=lower_collectives)
    return stage


def _load_flat(ctx: PassContext):
    """The zero3 pass's reader: entries of a meta parameter's TP shard, from the weights (``ctx.load_flat``)."""
    def load(fqn: str, like: torch.Tensor, start: int, end: int) -> torch.Tensor:
        info = ctx.program.params[ctx.program.canonical(fqn)]
        return ctx.load_flat(list(info.fqns), ctx.out.tp.layout(info.fqn), like, start, end).to(ctx.device)
    return load


def _release_sharded(ctx: PassContext, names: list[str]) -> None:
    """The full tensors of what ZeRO-3 sharded are no longer this rank's: the program and the shared TP
    shards keep meta stand-ins (shapes for later signatures, which find the buckets in the cache)."""
    tp_shards = ctx.shared.get("tp_shards", {})
    for fqn in names:
        t = ctx.program.tensor(fqn)
        if not t.is_meta:
            stand_in = torch.nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
            ctx.program.set_tensor(fqn, stand_in)
            if fqn in tp_shards:
                tp_shards[fqn] = stand_in


PROGRAM_PASSES = (  # Program -> Program: the whole traced graph, the same on every rank but for its TP coordinate
    Pass("fused_loss", _fused_loss, when=lambda c: c.plan.fused_loss),  # before TP: its rule splits the vocab
    Pass("tensor_parallel", _tensor_parallel, when=lambda c: c.mesh.tp > 1),  # before the split: layers still whole
    # before the split too: each stage keeps its MoE layers' dispatch and combine; the EpResult goes to
    # ctx.shared["ep"] (the compiled model's gradient groups, statistics and checkpoints read it)
    Pass("expert_parallel", _expert_parallel, when=lambda c: c.mesh.ep > 1, check=_expert_parallel_check),
    # after TP (heads split, then the sequence), before the split: each attention's gathers stay in its stage
    Pass("context_parallel", _context_parallel, when=lambda c: c.mesh.cp > 1,
         check=lambda program, c: context_parallel_check(program, c.mesh.cp)),
)
SPLIT = Pass("pipeline_split", _split)  # Program -> PipelineProgram; cuts chosen on the traced program (ctx.cuts)
STAGE_PASSES = (  # StageSpec -> StageSpec, only the stages this rank runs, pass-major
    Pass("materialize_weights", materialize_weights,
         when=lambda c: c.load is not None),  # after TP (loads only this rank's shards), before zero3 (flattens them)
    Pass("retarget_device", retarget_device,
         when=lambda c: c.load is not None and c.traced_on_meta),  # after weights: factory calls follow them
    # after the weights (each rank quantizes the TP shard it holds), before anything that reads the graph's linears
    Pass("quantize_base", quantize_base, when=lambda c: c.plan.base_dtype is not None),
    # before zero3: an in-place update of a parameter's detached value would update a view of its gathered bucket
    # (and, in a pipeline, bump the version of the value an earlier microbatch's backward saved)
    Pass("param_updates", param_updates, when=lambda c: param_updates_needed(c.plan, c.program)),
    Pass("zero3", _zero3, when=lambda c: c.plan.zero == 3),  # after TP and split: shards what this rank holds
    # under bf16 autocast, or where Dynamo will trace the stage (its docstring says why)
    Pass("drop_dtype_asserts", drop_dtype_asserts,
         when=lambda c: c.plan.mixed_precision == "bf16" or c.plan.compiles_on(c.device)),
    # after TP (its sequence-parallel gathers and reduce-scatters) and zero3 (its weight views), before
    # recompute (which outlines layers): chunks each gather -> linears and linear -> reduce-scatter
    Pass("collective_matmul", collective_matmul,
         when=lambda c: c.plan.collective_matmul > 1 and c.mesh.tp > 1),
    # last: it outlines each layer into a submodule no other pass looks into; after materialize_weights
    # (weights land on the stage's get_attr targets) and zero3 (each bucket's gather moves into the one
    # layer reading it, so backward regathers it by recomputing instead of holding the gathered bucket)
    Pass("recompute", recompute, when=lambda c: c.plan.recompute != "none"),
    # last: Inductor compiles the graph every pass above left (a build without process groups, one only
    # pricing its plan, has no ``compile_stage``)
    Pass("inductor", _inductor, when=lambda c: c.compile_stage is not None and c.plan.compiles_on(c.device)),
)


def check(program: Program, ctx: PassContext) -> None:
    """The program passes' preconditions on the traced ``program`` (compile runs them on its first trace,
    before any rank communicates): a PlanError where a pass the plan asks for cannot apply."""
    Runner(ctx).check(PROGRAM_PASSES, program)
    if ctx.plan.base_dtype is not None:
        quantize_base_check(program, ctx)


def run(program: Program, ctx: PassContext) -> tuple[Program, PipelineProgram]:
    """Compile ``program`` for the rank ``ctx.mesh`` stands for; the rewritten program and its stages."""
    runner = Runner(ctx)
    program = runner.run(PROGRAM_PASSES, program)
    ctx.program = program
    pipeline = runner.run((SPLIT,), program)
    ctx.pipeline = pipeline
    runner.run_stages(STAGE_PASSES, ctx.my_stages)
    return program, pipeline
