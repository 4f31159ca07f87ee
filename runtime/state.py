"""The state of a compiled model under the original FQNs: :func:`full_state_dict`, full tensors on every
rank (parameters or their gradients, gathered from TP shards, ZeRO-3 shards and the pipeline ranks that
hold them); :func:`local_state`, what this rank holds of each full tensor, as boxes of it (for sharded
checkpoints: nothing is gathered)."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fxpar.ir import quant_ops
from fxpar.ir.errors import PlanError
from fxpar.ir.mesh import MeshSpec
from fxpar.ir.placement import ShardLayout
from fxpar.ir.stage import CompileResult
from fxpar.runtime import dist_calls


def full_state_dict(result: CompileResult, model: torch.nn.Module, mesh: MeshSpec, device: torch.device,
                    grads: bool = False, ep=None, zero3=None, names=None) -> dict[str, torch.Tensor]:
    """Full tensors keyed by the original FQNs (tied parameters under each name), on every rank.
    ``grads=True``: the parameters' gradients from the last step instead (zeros where none). ``names``: only
    these (a collection of the model's names, the same on every rank; e.g. a PEFT model's adapters).

    TP shards are gathered within the owning stage's TP group, then sent from its TP rank 0. ZeRO-3
    parameters come from ``zero3`` (a :class:`~fxpar.runtime.zero3.Zero3Gatherer`: one bucket gathered at
    a time, values or gradients as ``grads`` says). ``ep`` (an :class:`~fxpar.ir.expert_ops.EpResult`):
    expert slices are gathered over the ep group (dim 0).
    """
    experts = ep.experts if ep is not None else {}
    pipeline, program = result.pipeline, result.program
    owner: dict[str, int] = {}
    for stage in pipeline.stages:
        for fqn in stage.params + stage.buffers:
            owner.setdefault(fqn, stage.rank)
    out = {}
    named = dict(model.named_parameters(remove_duplicate=False)) if grads else model.state_dict(keep_vars=True)
    for name, value in named.items():
        if names is not None and name not in names:
            continue
        try:
            fqn = program.canonical(name)
        except KeyError:  # a tensor the traced graph does not bind
            fqn = name
        mine = owner.get(fqn, mesh.pp_rank) == mesh.pp_rank
        local = program.tensor(fqn) if fqn in program.params else value
        if local.is_meta and fqn in owner and mine:  # a frozen base held in int8 blocks (Plan(base_dtype="int8"))
            held = quant_ops.held_weight([s.gm for s in pipeline.stages if s.rank == mesh.pp_rank], fqn, local,
                                         gathered=zero3)
            local = held if held is not None else local
        if zero3 is not None and fqn in zero3:
            local = zero3[fqn] if mine else local.detach()
        elif grads:
            local = local.grad if local.grad is not None else torch.zeros_like(local)
        layout = result.tp.layout(fqn)
        shape = list(local.shape) if layout is None else list(layout.full_shape(local.shape))
        if fqn in experts:  # this ep rank's experts: every ep rank's, in order, along dim 0
            shape[0] *= mesh.ep
            if mine:
                parts = [torch.empty_like(local) for _ in range(mesh.ep)]
                dist_calls.all_gather_list(parts, local.detach().contiguous(), mesh.group_name("ep"))
                full = torch.cat(parts)
            else:
                full = torch.empty(shape, dtype=local.dtype, device=device)
        elif layout is not None and mine:
            full = layout.unshard(_gather_tp(local.detach(), layout, shape, mesh))
        else:
            full = local.detach().clone() if mine else torch.empty(shape, dtype=local.dtype, device=device)
        if mesh.world_size > 1 and fqn in owner:
            dist_calls.broadcast(full, mesh.rank_of(pp=owner[fqn]))
        out[name] = full
    return out


def _gather_tp(local: torch.Tensor, layout: ShardLayout, shape: list[int], mesh: MeshSpec) -> list[torch.Tensor]:
    """Every TP rank's part of a tensor of full ``shape``, in rank order. Parts of different sizes (a dim the
    degree does not divide) travel padded to the largest, since an all-gather moves equal sizes."""
    sizes = layout.local_sizes(shape[layout.dim])
    d, most = layout.dim, max(sizes)
    padded = local.new_zeros(tuple(local.shape[:d]) + (most,) + tuple(local.shape[d + 1:]))
    padded.narrow(d, 0, local.shape[d]).copy_(local)
    parts = [torch.empty_like(padded) for _ in range(mesh.tp)]
    dist_calls.all_gather_list(parts, padded, mesh.group_name("tp"))
    return [p.narrow(d, 0, n) for p, n in zip(parts, sizes)]


# ---- what this rank holds of each full tensor (sharded checkpoints) ---------------------------------

@dataclass
class Held:
    """What this rank holds of one full tensor of ``shape``: ``chunks``, each ``(offsets, view)``: where a
    box starts in the full tensor and a view of this rank's memory with the box's sizes (writing into the
    view writes into the parameter, the ZeRO shard or the optimizer state it belongs to)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes ``(offsets, sizes)`` covering entries ``[a, b)`` of a row-major tensor of ``shape``: at most a
    partial first row, a block of whole rows and a partial last row, each level down (2 * dims - 1 boxes).

        >>> flat_boxes((3, 4), 2, 11)
        [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 3))]
    """
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = a // inner, (b - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a - first * inner, b - first * inner)]
    out = []
    if a % inner:
        out += [((first, *o), (1, *s)) for o, s in flat_boxes(shape[1:], a % inner, inner)]
        first += 1
    whole = b // inner  # rows [first, whole) are whole
    if whole > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole - first, *shape[1:])))
    if b % inner:
        out += [((whole, *o), (1, *s)) for o, s in flat_boxes(shape[1:], 0, b % inner)]
    return out


def place_tp(layout: ShardLayout | None, tp_rank: int, local_shape, offsets, view,
             whole_once: bool = False) -> list[tuple[tuple, torch.Tensor]]:
    """Where a box of TP rank ``tp_rank``'s shard (``offsets`` in the shard, ``view`` its data) lies in the
    full tensor: one box per fused piece it crosses (``layout.pieces``), as ``(full offsets, view)``.
    ``whole_once``: the pieces every rank holds whole only from TP rank 0 (writing: chunks must not overlap)."""
    if layout is None:
        return [(tuple(offsets), view)]
    d = layout.dim
    lo, hi = offsets[d], offsets[d] + view.shape[d]
    out, local_start = [], 0
    size = layout.full_shape(local_shape)[d]
    for i, (first, end) in enumerate(layout.ranges(size, tp_rank)):  # one range of the full tensor per piece
        whole, step = i in layout.whole, end - first  # whole: a piece every rank holds whole (ShardLayout.whole)
        a, b = max(lo, local_start), min(hi, local_start + step)
        if a < b and not (whole and whole_once and tp_rank != 0):
            o = list(offsets)
            o[d] = first + (a - local_start)
            out.append((tuple(o), view.narrow(d, a - lo, b - a)))
        local_start += step
    return out


def _flat_geometry(bucket, lo: int, hi: int, canonical):
    """Entries ``[lo, hi)`` of a flat bucket (ZeRO-3 parameters, ZeRO-1/2 optimizer shards): for a tensor
    laid out like that range, each parameter's boxes in its TP shard as views (``as_strided``) of it."""
    def geometry(flat: torch.Tensor):
        out = []
        for name, off, n, shape in zip(bucket.names, bucket.offsets, bucket.numels, bucket.shapes):
            s, e = max(off, lo), min(off + n, hi)
            if s >= e:
                continue
            strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
            boxes = []
            for o, z in flat_boxes(shape, s - off, e - off):
                start = (s - lo) + sum(i * st for i, st in zip(o, strides)) - (s - off)
                boxes.append((o, flat.as_strided(z, strides, flat.storage_offset() + start)))
            out.append((canonical(name), shape, boxes, True))
        return out
    return geometry


def _plain_geometry(fqn: str):
    return lambda t: [(fqn, tuple(t.shape), [((0,) * t.dim(), t)], False)]


def owning_ranks(pipeline) -> dict[str, int]:
    """FQN -> the pipeline rank that owns it: the first stage holding it (a tied parameter is on several).
    One rule for every "each entry once" question: who writes it to a checkpoint, who counts its norm."""
    owner: dict[str, int] = {}
    for stage in pipeline.stages:
        for fqn in stage.params + stage.buffers:
            owner.setdefault(fqn, stage.rank)
    return owner


def canonical_names(program):
    """``name -> program.canonical(name)``, a name the program does not know left as it is."""
    def canonical(name: str) -> str:
        try:
            return program.canonical(name)
        except KeyError:
            return name
    return canonical


def local_state(compiled, *, optimizer: bool = False, writers_only: bool = True) -> dict[str, Held]:
    """This rank's pieces of the model's tensors (``"model.<fqn>"``) and, with ``optimizer``, of its
    optimizer states (``"optim.<fqn>.<state>"``, e.g. ``exp_avg``), by original FQN and position in the
    full tensor: TP shards (fused pieces apart), ZeRO-3 and ZeRO-1/2 flat shards mapped back to boxes of
    each parameter. No tensor is gathered or copied: every chunk is a view.

    ``writers_only``: only the chunks this rank writes, so that each entry of each full tensor has exactly
    one writer: the owning pipeline rank (the first stage holding it, for tied parameters), one data-parallel
    replica of what is replicated over dp (chosen by FQN, to spread the bytes) or each dp rank its own
    ZeRO slice (of HSDP's copies of a slice, one replica), and one TP rank of what TP does not cut. Without it:
    everything this rank holds (to load into). Scalar states (``step``) go with the chunk at the tensor's origin."""
    result, mesh, program = compiled.result, compiled.spec, compiled.result.program
    pipeline, tp = result.pipeline, result.tp
    owner = owning_ranks(pipeline)
    canonical = canonical_names(program)
    ep = getattr(compiled, "ep", None)  # CompiledModel.ep: the expert-parallel record
    # expert slices: ep rank e holds rows [e * n, (e + 1) * n)
    experts = ep.info.experts if ep is not None and ep.info is not None else {}

    def writes(fqn: str, per_dp: bool) -> bool:
        if owner.get(fqn, mesh.pp_rank) != mesh.pp_rank:
            return False
        sharded, pick = tp.layout(fqn) is not None or fqn in experts, zlib.crc32(fqn.encode())
        if per_dp:  # a ZeRO slice: each shard rank its own; of HSDP's copies of it, one replica (by FQN)
            return (sharded or mesh.tp_rank == 0) and mesh.dp_replicate_rank == pick % mesh.dp_replicate
        if sharded:  # one rank of dp x cp
            return mesh.dp_rank == pick % mesh.dp and mesh.cp_rank == pick // mesh.dp % mesh.cp
        return (mesh.dp_rank, mesh.tp_rank) == divmod(pick % (mesh.dp * mesh.tp), mesh.tp) \
            and mesh.ep_rank == pick // (mesh.dp * mesh.tp) % mesh.ep \
            and mesh.cp_rank == pick // (mesh.dp * mesh.tp * mesh.ep) % mesh.cp  # one data replica of dp x ep x cp

    out: dict[str, Held] = {}

    def add(key: str, entries, dtype: torch.dtype) -> None:
        for fqn, local_shape, boxes, per_dp in entries:
            if writers_only and not writes(fqn, per_dp):
                continue
            layout = tp.layout(fqn)
            full = tuple(layout.full_shape(local_shape) if layout else local_shape)
            if fqn in experts:  # this ep rank's experts: its rows of the full tensor
                full = (full[0] * mesh.ep, *full[1:])
                boxes = [((o[0] + mesh.ep_rank * local_shape[0], *o[1:]), v) for o, v in boxes]
            held = out.setdefault(key.format(fqn), Held(full, dtype))
            for o, v in boxes:
                held.chunks += place_tp(layout, mesh.tp_rank, local_shape, o, v, whole_once=writers_only)

    geometry: dict[int, Callable] = {}  # id(tensor an optimizer steps) -> its geometry
    persistent = {canonical(n) for n in compiled.model.state_dict(keep_vars=True)}
    done: set[str] = set()
    for stage in pipeline.stages_of(mesh.pp_rank):
        for b in result.zero3_buckets.get(stage.index, []):
            geometry[id(b.shard)] = _flat_geometry(b, *b.shard_range(mesh.dp_shard_rank), canonical)
            add("model.{}", geometry[id(b.shard)](b.shard.detach()), b.shard.dtype)
            done.update(canonical(n) for n in b.names)
        for name, p in stage.gm.named_parameters():
            geometry.setdefault(id(p), _plain_geometry(canonical(name)))
        for fqn in stage.params + stage.buffers:
            if fqn not in done and fqn in persistent:
                t = program.tensor(fqn)
                add("model.{}", _plain_geometry(fqn)(t.detach()), t.dtype)
            done.add(fqn)
    if mesh.rank == 0:  # tensors of the model the traced program does not bind: rank 0 has them whole
        for name, t in compiled.model.state_dict(keep_vars=True).items():
            if canonical(name) not in done and name not in program.params and not t.is_meta:
                add("model.{}", _plain_geometry(name)(t.detach()), t.dtype)
    if optimizer and compiled.optimizer is not None:
        engine = compiled.engine
        for b in engine.buckets if engine is not None else []:
            if b.shard is not None:  # ZeRO-1/2: the optimizer steps this rank's slice of each bucket
                geometry[id(b.shard)] = _flat_geometry(b, b.lo, b.hi, canonical)
        for p, state in _optimizer_states(compiled.optimizer, geometry):
            where = geometry[id(p)]
            for k, v in state.items():
                if v.shape == p.shape:
                    add(f"optim.{{}}.{k}", where(v.detach()), v.dtype)
                    continue
                for fqn, _, boxes, per_dp in where(p.detach()):  # a scalar (step): once per FQN, kept by
                    origin = any(not any(o) for o, _ in boxes) and (mesh.tp_rank == 0 or tp.layout(fqn) is None) \
                        and (mesh.ep_rank == 0 or fqn not in experts)
                    if not writers_only or origin and writes(fqn, per_dp):  # the writer of the origin
                        out[f"optim.{fqn}.{k}"] = Held((), v.dtype, [((), v.detach())])
    return out


def _optimizer_states(opt, geometry: dict):
    """(parameter, its tensor states of its own shape or scalar) for every parameter ``opt`` steps."""
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in geometry:
                raise PlanError(f"an optimizer parameter of shape {tuple(p.shape)} belongs to no stage of this "
                                "rank: give compile an optimizer factory that uses the parameters it is given")
            yield p, {k: v for k, v in opt.state.get(p, {}).items()
                      if isinstance(v, torch.Tensor) and (v.shape == p.shape or v.dim() == 0)}
