"""Global gradient-norm clipping across TP shards, pipeline stages and ZeRO shards: the norm of the
gradient of the *whole* model, every entry of every parameter counted once, as
``torch.nn.utils.clip_grad_norm_`` computes it on one process.

Reads: the tensors this rank's optimizer steps (the rank's parameters; ZeRO-1/2's flat fp32 shards;
ZeRO-3's flat shard parameters), their gradients after the gradient synchronisation, the compiled
program's stages (who owns a parameter) and the TP pass's layouts. Writes: those gradients, scaled in
place by ``min(1, max_norm / (norm + 1e-6))`` (torch's ``clip_grads_with_norm_``).

Each rank holds some entries of the model's gradient, some of them also held elsewhere: a parameter TP
does not cut is whole on every TP rank, a gradient data parallelism all-reduces is whole on every dp
rank, a tied parameter (embedding and LM head) on every pipeline rank holding it. Each entry has one
*counting* rank, the rule ``fxpar.runtime.state.local_state`` uses to give every entry one writer: the
first pipeline rank holding the parameter; TP rank 0 for what TP does not cut (its gradient is the same
on every TP rank), each TP rank its own shard; for whole gradients dp rank 0, for ZeRO's flat shards
each dp rank its own slice (padding excluded; with HSDP the first replica's copy of each). Every rank sums the
squares of what it counts and one all-reduce of that scalar over the world gives the same norm everywhere; every
rank then scales all the gradients it steps, counted or not, by the same factor. Cost: one scalar all-reduce per step.

ZeRO-1/2 clip the flat shards their optimizer steps; the parameters' own ``.grad`` (views of the
reduced bucket under ZeRO-1) keep the unclipped values, which nothing steps.
"""

from __future__ import annotations

import math

import torch

from fxpar.ir.mesh import MeshSpec
from fxpar.ir.stage import CompileResult
from fxpar.runtime import dist_calls
from fxpar.runtime.state import canonical_names, owning_ranks

__all__ = ["check_max_grad_norm", "make_clipper", "stepped_tensors", "GradClipper"]


def check_max_grad_norm(max_grad_norm) -> float | None:
    """``max_grad_norm`` as a float (None: no clipping); a ValueError naming the fix for anything else.
    ``float('inf')`` measures the norm without clipping."""
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) \
            or math.isnan(max_grad_norm) or max_grad_norm <= 0:
        raise ValueError(f"fxpar.compile: max_grad_norm={max_grad_norm!r}; give a number > 0 (the largest "
                         "global L2 norm of the gradients), float('inf') to measure the norm without "
                         "clipping, or None for neither")
    return float(max_grad_norm)


def make_clipper(max_grad_norm, result: CompileResult, mesh: MeshSpec, named, engine, device, experts=frozenset()):
    """The compiled model's :class:`GradClipper`, or None without ``max_grad_norm``."""
    max_grad_norm = check_max_grad_norm(max_grad_norm)
    if max_grad_norm is None:
        return None
    return GradClipper(max_grad_norm, result, mesh, stepped_tensors(named, engine, result.zero3_buckets,
                                                                     mesh.dp_shard_rank), device, experts)


def stepped_tensors(named: list[tuple[str, torch.nn.Parameter]], engine, zero3_buckets: dict[int, list],
                    dp_rank: int) -> list:
    """What this rank's optimizer steps, for :class:`GradClipper`: ZeRO-1/2's flat shards (the engine's
    buckets, entries ``[lo, hi)``), else the rank's trainable parameters (``named``), ZeRO-3's flat shard
    parameters among them (their bucket's entries ``shard_range(dp_rank)``)."""
    if engine is not None and engine.zero in (1, 2):
        return [(b.shard, None, (b, (b.lo, b.hi))) for b in engine.buckets]
    zero3 = {id(b.shard): b for buckets in zero3_buckets.values() for b in buckets}
    out = []
    for name, p in named:
        if p.requires_grad:
            b = zero3.get(id(p))
            out.append((p, name, None) if b is None else (p, None, (b, b.shard_range(dp_rank))))
    return out


class GradClipper:
    """Measures (and clips) the global gradient norm of one compiled model on this rank.

    ``stepped``: ``(tensor the optimizer steps, its name in the stage or None, its flat bucket and the
    entries ``[lo, hi)`` of the bucket it holds, or None for a whole parameter)``."""

    def __init__(self, max_norm: float, result: CompileResult, mesh: MeshSpec, stepped: list, device,
                 experts=frozenset()):  # experts: FQNs of expert slices (Plan(ep=N): each ep rank its own)
        self.max_norm, self.device = max_norm, device
        self.world = mesh.world_size
        owner, canonical, tp = owning_ranks(result.pipeline), canonical_names(result.program), result.tp

        def counts(name: str, whole: bool) -> bool:
            fqn = canonical(name)
            if owner.get(fqn, mesh.pp_rank) != mesh.pp_rank:
                return False  # a tied parameter: its first pipeline rank counts it
            if tp.layout(fqn) is None and mesh.tp_rank != 0:
                return False  # whole on every TP rank
            # whole gradients are the same on every data replica and cp rank (an expert slice's: on every
            # dp and cp rank); a ZeRO slice is its shard rank's own, the same on each of HSDP's replicas (counted on
            # the first)
            return mesh.dp_replicate_rank == 0 if not whole else (mesh.dp_rank + mesh.cp_rank if fqn in experts
                                                                   else mesh.grad_rank) == 0

        self.tensors: list[torch.Tensor] = []
        self.ranges: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []  # (tensor, counted flat entries)

        def own(name: str, numel: int) -> list[tuple[int, int]]:
            """The entries of a parameter this TP rank counts: all, but the fused pieces every rank holds
            whole (ShardLayout.whole) on TP rank 0 only."""
            fqn = canonical(name)
            layout = tp.layout(fqn)
            if layout is None or not layout.whole or mesh.tp_rank == 0:
                return [(0, numel)]
            return _not_whole(layout, layout.local_shape(result.program.params[fqn].shape, mesh.tp_rank), mesh.tp_rank)

        for t, name, bucket in stepped:
            self.tensors.append(t)
            if bucket is None:
                if counts(name, whole=True):
                    self.ranges.append((t, own(name, t.numel())))
                continue
            flat, (lo, hi) = bucket
            mine = []
            for n, off, size in zip(flat.names, flat.offsets, flat.numels):
                if not counts(n, whole=False):
                    continue
                for ra, rb in own(n, size):
                    a, b = max(off + ra, lo), min(off + rb, hi)
                    if a >= b:
                        continue
                    if mine and mine[-1][1] == a - lo:
                        mine[-1] = (mine[-1][0], b - lo)  # adjacent entries: one slice
                    else:
                        mine.append((a - lo, b - lo))
            if mine:
                self.ranges.append((t, mine))
        self.last: torch.Tensor | None = None  # the last step's norm (a 0-dim float64 tensor)

    def counted(self) -> int:
        """How many gradient entries this rank counts (every entry of the model once over all ranks)."""
        return sum(b - a for _, rs in self.ranges for a, b in rs)

    def norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients (collective: every rank of the world calls it)."""
        pieces = []
        for t, rs in self.ranges:
            if t.grad is not None:
                g = t.grad.reshape(-1)
                pieces += [g[a:b] for a, b in rs]
        # float64, not torch's fp32 get_total_norm: a ZeRO shard's slice spans many parameters (tens of
        # thousands of entries), and its fp32 sum of squares drifted 2e-6 (relative) from clip_grad_norm_'s
        # per-parameter norms on tiny llama; in float64 only the reference's own rounding (~1e-7) is left
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for piece in pieces:
            sq += torch.linalg.vector_norm(piece, dtype=torch.float64).square().to(self.device)
        if self.world > 1:
            dist_calls.all_reduce(sq)
        return sq.sqrt()

    def last_norm(self) -> float | None:
        """The last measured norm as a Python float (None before the first)."""
        return None if self.last is None else self.last.item()

    def clip(self) -> torch.Tensor:
        """Measure the norm and scale every gradient this rank steps as ``clip_grad_norm_`` does."""
        total = self.norm()
        if math.isfinite(self.max_norm):
            grads = [t for t in self.tensors if t.grad is not None]
            if grads:
                torch.nn.utils.clip_grads_with_norm_(grads, self.max_norm, total.float())
        self.last = total
        return total


def _not_whole(layout, shape, rank: int) -> list[tuple[int, int]]:
    """Flat entries of one rank's shard (of ``shape``) outside the pieces every rank holds whole."""
    d = layout.dim
    outer, rows, inner = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:])
    out = []
    for o in range(outer):
        start = o * rows * inner
        for i, p in enumerate(layout.local_pieces(rank)):
            if i not in layout.whole:
                out.append((start, start + p * inner))
            start += p * inner
    return out
