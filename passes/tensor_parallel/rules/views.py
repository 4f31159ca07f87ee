"""Rules for ops that move, merge or cut dims: reshapes, transposes, permutes, flatten, expand, splits
and their pieces, cat and advanced indexing. A shard follows its dim; the sizes an op names at the
sharded dim become local ones; where a shard cannot follow, the input is gathered."""

from __future__ import annotations

import operator

import torch

from fxpar.ir import meta
from fxpar.ir.errors import PlanError
from fxpar.ir.function_op import is_function_node
from fxpar.ir.op_classes import RESHAPES, SPLITS, packet
from fxpar.ir.placement import Replicate, as_placement
from fxpar.passes.tensor_parallel.dim_moves import moved
from fxpar.passes.tensor_parallel.layouts import linear_weight, slice_bounds, split_args, split_dim
from fxpar.passes.tensor_parallel.rules.fused import whole_piece
from fxpar.passes.tensor_parallel.rules.pointwise import pointwise_or_gather
from fxpar.passes.tensor_parallel.rules.registry import rule

aten = torch.ops.aten


@rule(*RESHAPES)
def view(rw, old, args, kwargs):
    """A shard of a merged dim moves to its leading factor; the size named there becomes the local one."""
    x = args[0]
    d = rw.shard_dim(x)
    if d is None:
        return rw.call(old.target, args, kwargs, like=old)
    src = tuple(old.args[0].meta[meta.VAL].shape)
    dst = tuple(old.meta[meta.VAL].shape)
    od = moved(old, d)
    fused = rw.packing.values.get(old)  # a fused value with whole pieces: its local size from them
    local = sum(fused.local(rw.tp, rw.rank)) if fused is not None and od == fused.dim else None
    if od is not None and local is None and dst[od] < src[d] and rw.uneven(old.args[0], d) is not None:
        _split_uneven(rw, old, src, dst, d)
    if od is None or (local is None and dst[od] != src[d] and (dst[od] % rw.tp or rw.uneven(old.args[0], d))):
        x = rw.replicate(x, old.args[0])
        return rw.call(old.target, (x, *args[1:]), kwargs, like=old)
    sizes = list(args[1])
    if sizes[od] != -1:
        sizes[od] = rw.local_size(dst[od]) if local is None else local
    return rw.call(old.target, (x, sizes, *args[2:]), kwargs, like=old, place=as_placement(od))


def _split_uneven(rw, old, src, dst, d):
    """A dim tp does not divide, cut unevenly, reshaped into several (``[.., H * D]`` into ``[.., H, D]``):
    heads that do not divide over the ranks, which nothing can cut. A plan's style that asks for it is an
    error, as it was before uneven cuts (the inference never cuts such a dim). The message names the layer
    that made the value (the first linear-like node back along first inputs)."""
    made = old.args[0]
    while linear_weight(made)[0] is None and made.all_input_nodes:
        made = made.all_input_nodes[0]
    module = (made if linear_weight(made)[0] is not None else old).meta.get(meta.MODULE) or "(root)"
    raise PlanError(f"{module}: its output reshaped by {old.name} from {src} into {dst} splits dim {d} ({src[d]}), "
                    f"which tp={rw.tp} does not divide, into groups (heads) that cannot be cut apart; use a tp "
                    f"degree that divides {src[d]}, or keep {module} whole with "
                    f"--plan tp={rw.tp},tp_replicate={module} "
                    f"(in a plan file: tp_replicate = [\"{module}\"])")


@rule(aten.transpose, aten.numpy_T, aten.t, aten.permute, aten.unsqueeze)
def moves(rw, old, args, kwargs):
    """Dims reordered, or one added: the shard moves with its dim (:mod:`..dim_moves`)."""
    return rw.keep(old, args, kwargs, lambda d: moved(old, d))


@rule(aten.flatten)
def flatten(rw, old, args, kwargs):
    """flatten(start, end) keeps a shard outside the range, or on its first dim (the leading factor)."""
    d = rw.shard_dim(args[0])
    if d is None:
        return rw.call(old.target, args, kwargs, like=old)
    od = moved(old, d)
    if od is None:
        return rw.call(old.target, (rw.replicate(args[0], old.args[0]), *args[1:]), kwargs, like=old)
    return rw.call(old.target, args, kwargs, like=old, place=as_placement(od))


@rule(aten.expand, aten.broadcast_to)
def expand(rw, old, args, kwargs):
    """expand keeps the shard; the size it names at the sharded dim becomes the local one."""
    x = args[0]
    if rw.shard_dim(x) is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    d = moved(old, rw.shard_dim(x))
    sizes = list(args[1])
    if sizes[d] not in (-1, 1):
        sizes[d] = rw.local_size(sizes[d])
    return rw.call(old.target, (x, sizes, *args[2:]), kwargs, like=old, place=as_placement(d))


@rule(aten.slice)
def slice_(rw, old, args, kwargs):
    """A slice of a sharded value: as a split (below); of a replicated one, the fallback."""
    if rw.shard_dim(args[0]) is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    return split(rw, old, args, kwargs)


@rule(*SPLITS)
def split(rw, old, args, kwargs):
    """chunk/split/split_with_sizes/slice. Along another dim than the shard: the shard stays. Along
    the shard of a fused projection cut part by part: local pieces, no communication. Along any
    other shard: gathered first."""
    x = args[0]
    d = rw.shard_dim(x)
    if d is None:
        return rw.call(old.target, args, kwargs, like=old)
    nd = rw.ndim(old.args[0])
    dim = split_dim(old) % nd
    if dim != d:
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))
    if _strided_group(rw, old, dim):  # one group of an interleaving ([::2], [1::2]): the same slice locally
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))
    if old not in rw.packed_splits or rw.uneven(old.args[0], d) is not None:
        x = rw.replicate(x, old.args[0])
        return rw.call(old.target, (x, *args[1:]), kwargs, like=old)
    pkt = packet(old)
    size = old.args[0].meta[meta.VAL].shape[dim]
    given = split_args(old)
    if pkt is aten.chunk:
        local = (x, given["chunks"], dim)
    elif pkt is aten.split:
        local = (x, given["split_size"] // rw.tp, dim)
    elif pkt is aten.split_with_sizes:
        local = (x, [s // rw.tp for s in given["split_sizes"]], dim)
    else:  # slice
        start, end = slice_bounds(given, size)
        local = (x, dim, start // rw.tp, end // rw.tp)
    return rw.call(old.target, local, {}, like=old, place=as_placement(d))


@rule(operator.getitem)
def getitem(rw, old, args, kwargs):
    """A piece of a split (or of an elementwise Function's result list) keeps its shard; anything else
    taken from a tuple is replicated."""
    src = args[0]
    if src in rw.item_place:  # a piece of a fused value: cut, or whole on every rank (rules/fused.py)
        place = rw.item_place[src][args[1]]
        new = rw.call(old.target, args, kwargs, like=old, place=place)
        return whole_piece(rw, new, old) if isinstance(place, Replicate) else new
    place = rw.place.get(src, Replicate()) if packet(src) in SPLITS or is_function_node(src) else Replicate()
    return rw.call(old.target, args, kwargs, like=old, place=place)


@rule(aten.cat)
def cat(rw, old, args, kwargs):
    """cat along another dim than a shard shared by every input keeps it; else replicate."""
    parts, olds = list(args[0]), list(old.args[0])
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % rw.ndim(old)
    shards = {rw.shard_dim(p) for p in parts}
    if len(shards) == 1 and None not in shards and dim not in shards:
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(shards.pop()))
    parts = [rw.replicate(p, o) for p, o in zip(parts, olds)]
    return rw.call(old.target, (parts, *args[1:]), kwargs, like=old)


@rule(aten.index)
def index(rw, old, args, kwargs):
    """Advanced indexing with replicated index tensors, all after the shard, keeps it; else gathered."""
    x, indices = args[0], list(args[1])
    d = rw.shard_dim(x)
    if d is None:
        return pointwise_or_gather(rw, old, args, kwargs)
    used = [i for i, t in enumerate(indices) if t is not None]
    replicated = all(rw.is_replicated(t) for t in indices if isinstance(t, torch.fx.Node))
    if used and min(used) > d and replicated:
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(d))
    if used and max(used) < d and used == list(range(used[0], used[-1] + 1)) and replicated:
        # indices in one block before the shard (expert weights gathered by router output): their dims
        # replace the block's, the shard moves with the dims after it
        nd_idx = max(rw.ndim(t) for t in old.args[1] if isinstance(t, torch.fx.Node))
        return rw.call(old.target, args, kwargs, like=old, place=as_placement(d - len(used) + nd_idx))
    return pointwise_or_gather(rw, old, args, kwargs, force_gather=True)


def _strided_group(rw, old, dim: int) -> bool:
    """A slice ``[start::step]`` over a whole dim whose local part holds whole groups of ``step``: each
    rank's slice is its part of the sliced value (gate/up interleaved as ``[g0, u0, g1, u1, ...]``)."""
    if packet(old) is not aten.slice:
        return False
    given = split_args(old)
    size = old.args[0].meta[meta.VAL].shape[dim]
    start, end = slice_bounds(given, size)
    step = given.get("step", 1)
    return step > 1 and start < step and end == size and size % rw.tp == 0 and (size // rw.tp) % step == 0
