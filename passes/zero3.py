"""ZeRO-3 as a graph pass: parameters live sharded over the data-parallel ranks and are gathered where
the graph first uses them.

Reads: a pipeline stage's GraphModule, whose parameters are ``get_attr`` nodes under their FQNs.
Writes: per bucket (a layer's parameters by default; consecutive layers merged up to ``bucket_bytes``;
frozen parameters, ``requires_grad=False``, in buckets of their own, gathered but never reduced)
one flat shard parameter ``_zero3.<i>`` on the module (this rank's 1/dp of the bucket, padded), one
``torch.ops.fxpar.gather_params`` node (all-gather forward; reduce-scatter of the gradient backward)
and per parameter a slice + view of the gathered bucket replacing its ``get_attr``. The gather is
placed ``prefetch`` buckets ahead of its first use (0: just before it), so it can be issued while the
previous bucket computes. ``Plan(comm_dtype="int8")`` gives the gathers their int8 wire format (and
``quantize_grads`` their gradients' reduce-scatter), as an argument of the node. Buffers stay whole.
The runtime frees the gathered bucket after its last forward use and gathers it again for backward
(``fxpar.runtime.zero3.Zero3Regather``).

A head read only by the fused loss (``Plan(fused_loss=True)``: ``fxpar_kernels.linear_cross_entropy``, not
split by TP) is never gathered: its bucket holds it alone, each rank's shard is its rows ``[r V/dp, (r+1)
V/dp)`` of the vocabulary, and the loss runs vocabulary-parallel over the dp group on the tokens of every dp
rank (:func:`_head_on_shards`): the hidden states are all-gathered (backward: reduce-scattered), so are the
labels, the loss's max / sum-exp reductions run over the group inside the op, and each rank keeps its own
tokens' losses (backward: all-gathered). A rank then holds its head rows and a ``[dp T, H]`` hidden state
where it held the whole ``[V, H]`` head, and moves the ``dp T H`` hidden states twice (gathered, their gradient
reduce-scattered) where the head went three times (gathered, regathered, its gradient reduce-scattered); the
head's gradient is made on the rank that owns it, summed over every rank's tokens, what a reduce-scatter would
have left there. It needs ``V`` divisible by dp (each rank's shard whole rows, no padding).

ZeRO-3 is this pass and ``fxpar.runtime.zero3``, nothing else. A bucket's flat layout is
:class:`~fxpar.ir.buckets.FlatBucket`, the same one DDP and ZeRO-1/2 use for their gradient buckets.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx

from fxpar.ir import fused_ops, meta
from fxpar.ir.buckets import FlatBucket
from fxpar.ir.ops import gather_params_op
from fxpar.ir.program import layer_of

aten = torch.ops.aten


class Zero3Bucket(FlatBucket):
    """One bucket: the flat layout of its parameters (FQNs, shapes, offsets) and this rank's shard.

    The shard is filled parameter by parameter with only the entries it owns: ``read(i, start, end)``
    gives entries ``[start, end)`` of parameter ``i``, flat (a slice of a real tensor, or read from the
    weights of a meta model), so building it never holds the bucket, or a parameter, whole."""

    def __init__(self, names: list[str], tensors: list[torch.Tensor], dp: int, rank: int,
                 read: Callable[[int, int, int], torch.Tensor], device: torch.device):
        super().__init__(names, [t.shape for t in tensors], dp)
        lo, hi = self.shard_range(rank)
        shard = torch.zeros(self.shard_numel, dtype=tensors[0].dtype, device=device)
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            if shard.is_meta:  # a meta model's priced build (fxpar.api.price): shapes, no values to read
                break
            s, e = max(off, lo), min(off + n, hi)
            if s < e:
                shard[s - lo:e - lo] = read(i, s - off, e - off)
        self.shard = torch.nn.Parameter(shard, requires_grad=any(t.requires_grad for t in tensors))


def buckets_of(names: list[str], tensors: dict[str, torch.Tensor], bucket_bytes: int,
               group_of: Callable[[str], int] | None = None) -> list[list[str]]:
    """Parameters in first-use order, grouped by layer, consecutive layers merged while under
    ``bucket_bytes`` (0: one bucket per layer). Parameters of different dtypes never share a bucket, nor
    do those of different optimizer parameter groups (``group_of``: FQN -> group): each group of a layer
    is a bucket of its own, and merging joins buckets of one group."""
    group = group_of if group_of is not None else (lambda n: 0)

    def nbytes(ns):
        return sum(tensors[n].numel() * tensors[n].element_size() for n in ns)
    runs: list[list[str]] = []
    open_: dict[int, list[str]] = {}  # group -> its run in the current layer
    for name in names:
        cur = open_.get(group(name))
        if cur is None or layer_of(cur[-1]) != layer_of(name) or tensors[cur[-1]].dtype != tensors[name].dtype:
            cur = open_[group(name)] = []
            runs.append(cur)
        cur.append(name)
    merged: list[list[str]] = []
    open_ = {}
    for run in runs:
        cur = open_.get(group(run[0]))
        if cur is not None and bucket_bytes and tensors[cur[-1]].dtype == tensors[run[0]].dtype and \
                nbytes(cur) + nbytes(run) <= bucket_bytes:
            cur.extend(run)
        else:
            cur = open_[group(run[0])] = list(run)
            merged.append(cur)
    return merged


def zero3(gm: torch.fx.GraphModule, params: list[str], dp: int, rank: int, *, group: str = "dp",
          bucket_bytes: int = 0, prefetch: int = 1, compute_dtype: torch.dtype | None = None,
          cache: dict[tuple, Zero3Bucket] | None = None,
          comm_dtype: str | None = None, group_of: Callable[[str], int] | None = None,
          load_flat: Callable[[str, torch.Tensor, int, int], torch.Tensor] | None = None,
          device: torch.device | None = None, held: frozenset[str] = frozenset()) -> list[Zero3Bucket]:
    """Rewrite ``gm`` (a stage) so its parameters ``params`` (FQNs) are gathered from dp shards.

    ``compute_dtype``: gather (and compute with) parameters in this dtype, e.g. bf16 mixed precision;
    the shards stay in their own dtype (fp32 master weights) and so do gradient reductions.
    ``cache``: buckets from another signature of the same stage (training and inference share shards).
    ``comm_dtype``: the gathers' wire format (``"int8"``, ``"int8+grads"``: :mod:`fxpar.ir.wire`); None
    writes the 4-argument node, full precision. ``group_of``: FQN -> optimizer parameter group; a bucket
    holds one group's parameters only (its flat shard goes into that group). ``load_flat(fqn, like, start,
    end)``: entries ``[start, end)`` of a meta parameter (a meta model's weights), read into the shard
    (on ``device``) without the rest of it. ``held``: frozen tensors of ``params`` gathered as they are held,
    never cast to ``compute_dtype`` nor sent in ``comm_dtype``'s wire format (QLoRA's int8 codes and their
    fp32 scales, buffers of ``gm``: ``passes/quantize_base.py``).
    Returns the stage's buckets; their ``shard`` parameters are what the optimizer updates."""
    cache = {} if cache is None else cache
    graph = gm.graph
    getters = {n.target: n for n in graph.nodes if n.op == "get_attr" and n.target in set(params)}
    order = [n.target for n in graph.nodes if n.op == "get_attr" and n.target in getters]
    tensors = {name: gm.get_buffer(name) if name in held else gm.get_parameter(name) for name in order}
    position = _position(graph)

    def gathered_as(n: str) -> tuple:  # the gather's cast and wire format
        return (None, None) if n in held else (compute_dtype, comm_dtype)
    # frozen parameters (requires_grad=False) are sharded and gathered too, in buckets of their own: a frozen
    # shard's gather records no backward, so its bucket is never reduce-scattered. Frozen tensors gathered
    # alike share buckets (QLoRA's codes, their scales and the norms are three kinds under bf16)
    frozen = {n for n in order if not tensors[n].requires_grad}
    # heads the fused loss reads on their shards, in buckets of their own; a parameter another signature of
    # this stage bucketed alone stays alone here (the signatures share their buckets through ``cache``)
    heads = {n for n in order if _head_rows(getters[n], tensors[n], dp, held, cache)}
    alone = heads | {key[0] for key in cache if len(key) == 1 and key[0] in getters}
    groups = buckets_of(order, tensors, bucket_bytes,
                        lambda n: ("alone", n) if n in alone else
                        (group_of(n) if group_of is not None and n not in frozen else 0, n in frozen,
                         *((tensors[n].dtype, *gathered_as(n)) if n in frozen else ())))
    # the node that first reads each bucket's parameters, and the buckets in the order the graph reads them
    first_use = [min((u for n in names for u in getters[n].users), key=position) for names in groups]
    order = sorted(range(len(groups)), key=lambda i: position(first_use[i]))
    buckets = []
    for i, names in enumerate(groups):
        key = tuple(names)
        bucket = cache.get(key)
        if bucket is None:
            ts = [tensors[n] for n in names]
            bucket = cache[key] = Zero3Bucket(names, ts, dp, rank, _reader(names, ts, load_flat),
                                              device if ts[0].is_meta and device is not None else ts[0].device)
        buckets.append(bucket)
        gm.register_parameter(f"_zero3_{i}", bucket.shard)
    for k, i in enumerate(order):
        bucket, names, attr = buckets[i], groups[i], f"_zero3_{i}"
        if names[0] in heads:
            _head_on_shards(graph, gm, getters[names[0]], bucket, attr, group, dp, rank)
            continue
        # issued where the bucket ``prefetch`` places earlier in the graph's order starts being read
        anchor = first_use[order[k - prefetch]] if prefetch and k >= prefetch else first_use[i]
        cast, wire = gathered_as(names[0])
        with graph.inserting_before(anchor):
            shard = graph.get_attr(attr)
            args = (shard, group, 0, cast) + ((wire,) if wire else ())
            full = graph.call_function(gather_params_op(), args)
            full.meta[meta.ZERO3_BUCKET] = tuple(names)
        # shapes on the new nodes (meta tensors), as every other node carries them
        shard.meta[meta.VAL] = torch.empty_like(bucket.shard, device="meta")
        dtype = cast or bucket.shard.dtype
        full.meta[meta.VAL] = torch.empty(bucket.shard_numel * dp, dtype=dtype, device="meta")
        _unflatten(graph, gm, full, bucket, getters, dtype)
    graph.lint()
    gm.recompile()
    return buckets


def _unflatten(graph: torch.fx.Graph, gm: torch.fx.GraphModule, full: torch.fx.Node, bucket: Zero3Bucket,
               getters: dict[str, torch.fx.Node], dtype: torch.dtype) -> None:
    """Each parameter of the gathered bucket ``full`` as a view of it, replacing its ``get_attr``: one
    ``split_with_sizes`` (the padding its last piece), then a ``view`` per parameter. One split, not a
    slice per parameter: the backward of a slice makes a zero tensor of the whole bucket for each
    parameter, the split's backward concatenates their gradients into one."""
    sizes = bucket.numels + ([bucket.padding] if bucket.padding else [])
    with graph.inserting_after(full):
        split = graph.call_function(aten.split_with_sizes.default, (full, sizes))
    split.meta[meta.VAL] = [torch.empty(k, dtype=dtype, device="meta") for k in sizes]
    cursor = split
    for j, (name, k, shape) in enumerate(zip(bucket.names, bucket.numels, bucket.shapes)):
        with graph.inserting_after(cursor):
            piece = graph.call_function(operator.getitem, (split, j))
        with graph.inserting_after(piece):
            view = graph.call_function(aten.view.default, (piece, list(shape)))
        piece.meta[meta.VAL] = split.meta[meta.VAL][j]
        view.meta[meta.VAL] = torch.empty(shape, dtype=dtype, device="meta")
        for m in (meta.MODULE, meta.NN_MODULE_STACK):
            if m in getters[name].meta:
                view.meta[m] = getters[name].meta[m]
        cursor = view
        getters[name].replace_all_uses_with(view)
        graph.erase_node(getters[name])
        _delete_param(gm, name)


def _head_rows(getter: torch.fx.Node, t: torch.Tensor, dp: int, held, cache) -> bool:
    """Whether the parameter ``getter`` reads is a head the fused loss computes on its shards (module docstring):
    a ``[V, H]`` weight, ``V`` divisible by ``dp``, whose every reader is a fused loss not split by TP reading
    it as the weight, and no other signature of the stage put it in a bucket with other parameters."""
    if dp < 2 or getter.target in held or t.dim() != 2 or t.shape[0] % dp:
        return False
    if any(getter.target in key and len(key) > 1 for key in cache):
        return False
    return read_as_head(getter)


def read_as_head(node: torch.fx.Node) -> bool:
    """Whether every reader of ``node`` (a parameter's ``get_attr`` or placeholder) is a fused loss not split by
    TP that reads it as its weight and nothing else: the graph side of the rule (the cost model reads it too,
    ``fxpar.planner.variants.FusedLoss``)."""
    op = fused_ops.FUSED_OPS["linear_cross_entropy"]
    for u in node.users:
        if u.op != "call_function" or u.target != op or len(u.args) != 8 or u.kwargs:
            return False
        if u.args[1] is not node or node in (u.args[0], *u.args[2:]) or u.args[4] is not None:
            return False
    return bool(node.users)


def _head_on_shards(graph: torch.fx.Graph, gm: torch.fx.GraphModule, getter: torch.fx.Node, bucket: Zero3Bucket,
                    attr: str, group: str, dp: int, rank: int) -> None:
    """Each fused loss reading ``getter`` (a head, :func:`_head_rows`) rewritten to compute on this rank's rows of
    it over the dp group ``group`` (module docstring), the head's ``get_attr`` replaced by its shard's view."""
    fx = torch.ops.fxpar
    vocab, hidden = bucket.shapes[0]
    rows = vocab // dp
    with graph.inserting_before(getter):
        shard = graph.get_attr(attr)
        weight = graph.call_function(aten.view.default, (shard, [rows, hidden]))
    shard.meta[meta.VAL] = torch.empty_like(bucket.shard, device="meta")
    weight.meta[meta.VAL] = torch.empty(rows, hidden, dtype=bucket.shard.dtype, device="meta")
    for m in (meta.MODULE, meta.NN_MODULE_STACK):
        if m in getter.meta:
            weight.meta[m] = getter.meta[m]

    def gathered(x: torch.fx.Node, op) -> torch.fx.Node:
        new = graph.call_function(op, (x, group, 0))
        v = x.meta[meta.VAL]
        new.meta[meta.VAL] = v.new_empty((v.shape[0] * dp, *v.shape[1:]), device="meta")
        return new
    for loss in list(getter.users):
        h, _, labels, _, _, ignore, chunk, _ = loss.args
        with graph.inserting_before(loss):
            h_all = gathered(h, fx.all_gather_rs_bwd.default)
            labels_all = gathered(labels, fx.all_gather.default)
        loss.args = (h_all, weight, labels_all, rank * rows, group, ignore, chunk, False)
        per_token = labels_all.meta[meta.VAL]
        loss.meta[meta.VAL] = tuple(torch.empty(per_token.shape, dtype=torch.float32, device="meta")
                                    for _ in range(2))
        for item in list(loss.users):  # each output: every dp rank's tokens -> this rank's
            mine = item.meta[meta.VAL]
            item.meta[meta.VAL] = loss.meta[meta.VAL][item.args[1]]
            with graph.inserting_after(item):
                own = graph.call_function(fx.scatter_slice.default, (item, group, 0))
            own.meta[meta.VAL] = mine
            item.replace_all_uses_with(own, delete_user_cb=lambda u: u is not own)
    graph.erase_node(getter)
    _delete_param(gm, getter.target)


def _reader(names: list[str], tensors: list[torch.Tensor], load_flat) -> Callable[[int, int, int], torch.Tensor]:
    def read(i: int, start: int, end: int) -> torch.Tensor:
        t = tensors[i]
        if not t.is_meta:
            return t.detach().reshape(-1)[start:end]
        if load_flat is None:
            raise RuntimeError(f"fxpar.passes.zero3: {names[i]} is on the meta device and no weights were given")
        return load_flat(names[i], t, start, end)
    return read


def _position(graph: torch.fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: index[n]


def _delete_param(gm: torch.nn.Module, fqn: str) -> None:
    *path, leaf = fqn.split(".")
    mod = gm
    for p in path:
        mod = getattr(mod, p)
    delattr(mod, leaf)
