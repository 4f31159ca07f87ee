"""Parameters held by stages on different pipeline ranks (a tied embedding and LM head): one process
group per (replica, TP rank) over the ranks holding them, and the sum of their gradients after backward."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from fxpar.ir.mesh import MeshSpec
from fxpar.ir.program import Program
from fxpar.ir.stage import PipelineProgram
from fxpar.runtime import dist_calls


def make_tied_groups(pipeline: PipelineProgram, mesh: MeshSpec, stage_to_rank, *, create: bool = True,
                     program: Program | None = None) -> list[tuple[str, list[int], object]]:
    """``(fqn, pipeline ranks holding it, this rank's process group)`` for each trainable parameter held on
    several pipeline ranks (``program``'s parameters with ``requires_grad=False`` have no gradient to sum).
    Every rank creates every group, in the same order (``new_group`` is collective); ``create=False`` lists
    them without creating any (pricing a plan)."""
    groups = []
    for fqn, stages in sorted(pipeline.tied.items()):
        ranks = sorted({stage_to_rank[s] for s in stages})
        if len(ranks) > 1 and (program is None or program.params[fqn].requires_grad):
            mine = None
            if create:
                me = mesh.coords()
                at = (me["dp"], me["tp"], me.get("ep", 0), me.get("cp", 0))
                for d, e, c, t in itertools.product(range(mesh.dp), range(mesh.ep), range(mesh.cp), range(mesh.tp)):
                    # (ep, cp = 1 but for expert and context parallelism: another data replica, another chunk)
                    g = dist.new_group([mesh.rank_of(d, r, t, e, c) for r in ranks])
                    mine = g if (d, t, e, c) == at else mine
            groups.append((fqn, ranks, mine))
    return groups


def sum_tied_grads(groups, program, pp_rank: int) -> None:
    """All-reduce the gradient of every tied parameter this rank holds over the ranks holding it."""
    for fqn, ranks, group in groups:
        if pp_rank in ranks:
            p = program.tensor(fqn)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist_calls.all_reduce(p.grad, group)
