"""The training step and the inference pass of a compiled model, each over microbatches already cut.

:class:`TrainingStep` owns what a step updates: the data-parallel engine (or the plain optimizer), the
gradient clipper, the tied gradients' groups and the expert-parallel record; :func:`gather_outputs` puts
the model's outputs of an inference pass together on every rank. Both read this rank's coordinates from
its :class:`~fxpar.ir.mesh.MeshSpec`; ``fxpar.runtime.model.CompiledModel`` cuts the batch, picks the
program for its shapes and calls them.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from fxpar.ir.mesh import MeshSpec
from fxpar.ir.options import run_options
from fxpar.ir.stage import CompileResult
from fxpar.runtime import dist_calls
from fxpar.runtime.memtrack import trim_heap
from fxpar.runtime.tied import sum_tied_grads

STEP_HEAP_SLACK = 64 * 2**20  # FXPAR_TRIM_STEP: a step gives the heap's free pages back past this (memtrack.trim_heap)


class TrainingStep:
    """Forward and backward over this rank's microbatches, gradient sync, clipping, optimizer step.

    Reads: the program and runtime of the batch's signature, this rank's microbatches and their loss
    weights. Writes: the parameters and their gradients, the optimizer's states, the engine's and the EP
    record's counters of the step, ``steps``."""

    def __init__(self, spec: MeshSpec, device: torch.device, engine, optimizer, clipper, tied_groups, ep):
        self.spec, self.device = spec, device
        self.engine, self.optimizer, self.clipper = engine, optimizer, clipper
        self.tied_groups, self.ep = tied_groups, ep
        self.steps = 0  # training steps run

    def run(self, result: CompileResult, runtime, mine: list, weights: list, params: list, key) -> torch.Tensor:
        """One step over ``mine`` (this rank's microbatches, ``weights`` their shares of the global batch's
        loss); ``params``: this rank's parameters of ``result``'s stages; ``key``: the program's signature
        (the engine learns gradient counts per program). The batch's loss, the same on every rank."""
        spec = self.spec
        for p in params:
            p.grad = None
        if self.engine is not None:
            self.engine.start_step(key)
        self.ep.start()  # the all-to-all bytes and the experts' loads of this step
        out = runtime.run(mine, train=True, loss_weights=weights)
        sum_tied_grads(self.tied_groups, result.program, spec.pp_rank)
        loss_stage = next(s for s in result.pipeline.stages if result.pipeline.loss_output in s.final)
        loss = sum((out.losses[i].detach() for i in sorted(out.losses)), torch.zeros(())).to(self.device).reshape(())
        work = None
        if spec.world_size > 1:  # the loss stage's TP and CP rank 0 of every replica holds its share of the loss
            if not (loss_stage.rank == spec.pp_rank and spec.tp_rank == 0 and spec.cp_rank == 0):
                loss.zero_()
            # in flight while gradients sync and the optimizer steps
            work = dist_calls.all_reduce(loss, async_op=True)
        if self.engine is not None:
            self.engine.finish()
        if self.clipper is not None:  # between the gradients' sync and the optimizer step
            self.clipper.clip()
        if self.engine is not None:
            self.engine.update()
        elif self.optimizer is not None:
            self.optimizer.step()
        if work is not None:
            work.wait()
        self.ep.finish()
        self.steps += 1
        if run_options().trim_step:  # FXPAR_TRIM_STEP: the freed activations and buckets go back to the system
            trim_heap(STEP_HEAP_SLACK)
        return loss


def gather_outputs(result: CompileResult, out, spec: MeshSpec, m: int, device: torch.device, scalar_weights):
    """The model's outputs of an inference pass (``out``: the pipeline runtime's), whole on every rank:
    every replica's slice written in place by its owner (the stage's TP rank 0), then summed. A scalar
    output is each microbatch's weighted by ``scalar_weights(j)``, this rank's shares for output ``j``."""
    pipeline, outs = result.pipeline, []
    for j in range(pipeline.num_user_outputs):
        stage = next((s for s in pipeline.stages if j in s.final), None)
        if stage is None:
            outs.append(None)
            continue
        val = stage.output_val(stage.final[j])
        shape = (val.shape[0] * m * spec.replicas, *val.shape[1:]) if val.dim() > 0 else ()
        full = torch.zeros(shape, dtype=val.dtype, device=device)
        if stage.rank == spec.pp_rank and spec.tp_rank == 0 and spec.cp_rank == 0:
            parts = [out.outputs[i][j] for i in range(m)]
            if val.dim() > 0:
                n = val.shape[0] * m
                full[spec.replica_rank * n:(spec.replica_rank + 1) * n] = torch.cat(parts)
            else:  # a scalar; the loss weighs each microbatch by its share of the batch's counted labels
                full = sum((a * b for a, b in zip(scalar_weights(j), parts) if a),
                           torch.zeros((), device=device)).to(val.dtype)
        if spec.world_size > 1:
            dist_calls.all_reduce(full)
        outs.append(full)
    return pytree.tree_unflatten(outs, result.program.out_spec)
