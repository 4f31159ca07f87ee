"""The collective ops of fxpar's IR: ``torch.ops.fxpar.*`` custom ops with autograd, fake and real kernels.

Design, in short:

* Each collective is a functional ``torch.library`` custom op (namespace ``fxpar``; it returns a new
  tensor, never mutates or aliases its input), so it is an ordinary node of an ATen graph: torch.export,
  make_fx and FakeTensorMode trace it through its fake kernel, and passes can count, bucket and reorder
  it. Its backward formula is written with fxpar ops too, so a traced backward shows its collectives.
* Gradient convention (Megatron's): a tensor replicated across a group has one gradient, held
  identically by every rank. ``all_reduce`` (the "g" after a row-parallel linear) thus has an identity
  backward, ``identity_fwd_all_reduce_bwd`` ("f") an all-reduce backward, ``all_gather`` a slice
  backward. ``all_gather_rs_bwd`` is the all-gather whose input gradient is a per-rank partial sum
  (sequence parallel, ZeRO-3), hence a reduce-scatter backward.
* A group is named by a string ("tp", "dp", "tp:0,1", "world") and resolved when the op runs
  (:mod:`fxpar.runtime.groups`, re-exported here). Fake kernels only need its size, so a program can be
  traced for a group that does not exist. Without torch.distributed every op is a copy.
* Real kernels call the plain torch.distributed collectives (gloo on CPU, NCCL on GPU) and wait with the
  process group's own timeout (``timeout=`` of ``init_process_group`` / ``new_group``): nothing waits
  for ever. A failure or timeout becomes a :class:`CollectiveError` naming the op, group and shapes;
  so do local shape errors. :func:`set_shape_checks` (or ``FXPAR_CHECK_COLLECTIVES=1``) also compares
  shapes across ranks before each collective, for debugging.
* Byte accounting: :func:`collective_bytes` gives raw payload bytes (the full, unsharded tensor each
  collective works on); :func:`ring_bytes` / :func:`collective_ring_bytes` turn them into what each rank
  sends under ring algorithms.
"""

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx

from fxpar.ir.errors import FxparError
from fxpar.runtime.groups import (  # noqa: F401  (re-exported: the ops' public API)
    _dist_up,
    group_size,
    new_group,
    new_subgroups,
    register_group,
    registered_groups,
    resolve_group,
    unregister_group,
)

__all__ = [
    "COLLECTIVE_OPS",
    "CollectiveError",
    "all_gather",
    "all_gather_rs_bwd",
    "all_reduce",
    "collective_bytes",
    "collective_kind",
    "collective_ring_bytes",
    "count_collectives",
    "group_size",
    "identity_fwd_all_reduce_bwd",
    "new_group",
    "new_subgroups",
    "reduce_scatter",
    "register_group",
    "registered_groups",
    "resolve_group",
    "ring_bytes",
    "scatter_slice",
    "set_shape_checks",
    "unregister_group",
]

# Every op of the namespace, in a fixed order (the keys of count_collectives and collective_bytes).
COLLECTIVE_OPS = (
    "all_reduce",
    "identity_fwd_all_reduce_bwd",
    "all_gather",
    "all_gather_rs_bwd",
    "reduce_scatter",
    "scatter_slice",
    "gather_params",
)

# op -> (communication its forward does, communication its backward does); None: no communication.
_COMMS: dict[str, tuple[str | None, str | None]] = {
    "all_reduce": ("all_reduce", None),
    "identity_fwd_all_reduce_bwd": (None, "all_reduce"),
    "all_gather": ("all_gather", None),
    "all_gather_rs_bwd": ("all_gather", "reduce_scatter"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "scatter_slice": (None, "all_gather"),
    # ZeRO-3: gathered for forward, gathered again for backward (fxpar.runtime.data_parallel), gradient
    # reduce-scattered: its backward payload counts twice
    "gather_params": ("all_gather", "all_gather+reduce_scatter"),
}

_REDUCE_OPS = ("sum", "avg", "max", "min")


class CollectiveError(FxparError):
    """A collective that cannot run (bad shapes, unknown group, not a member) or that failed or timed
    out. ``op`` is the fxpar op, ``group`` the group's name, ``sizes`` the shapes involved."""

    def __init__(self, message: str, *, op: str, group: str, sizes=None):
        self.op = op
        self.group = group
        self.sizes = sizes
        super().__init__(f"fxpar.{op} on group {group!r}: {message}")


# ---------------------------------------------------------------------------------------------------
# Checks and communication helpers

_SHAPE_CHECKS = os.environ.get("FXPAR_CHECK_COLLECTIVES", "") not in ("", "0")


def set_shape_checks(enabled: bool) -> bool:
    """Compare every collective's input shape and dtype across the group before running it (one more
    small collective each); a mismatch raises :class:`CollectiveError` on every rank instead of a
    hang or garbage. Off by default (``FXPAR_CHECK_COLLECTIVES=1`` turns it on). Returns the old value."""
    global _SHAPE_CHECKS
    old, _SHAPE_CHECKS = _SHAPE_CHECKS, bool(enabled)
    return old


def _norm_dim(op: str, group: str, x: torch.Tensor, dim: int) -> int:
    nd = x.dim()
    if not -nd <= dim < nd:
        raise CollectiveError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}",
                              op=op, group=group, sizes=[tuple(x.shape)])
    return dim % nd


def _shard_len(op: str, group: str, x: torch.Tensor, dim: int, n: int) -> int:
    """x.shape[dim] // n, raising unless n divides it."""
    size = x.shape[dim]
    if size % n:
        raise CollectiveError(
            f"dim {dim} has size {size}, which does not split into {n} equal shards "
            f"(input shape {tuple(x.shape)}, group size {n})",
            op=op, group=group, sizes=[tuple(x.shape)],
        )
    return size // n


def _check_reduce_op(op: str, group: str, reduce_op: str, x: torch.Tensor) -> None:
    if reduce_op not in _REDUCE_OPS:
        raise CollectiveError(f"unknown reduction {reduce_op!r}; use one of {_REDUCE_OPS}", op=op, group=group)
    if reduce_op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise CollectiveError(f"'avg' needs a floating tensor, got {x.dtype}", op=op, group=group)


def _membership(op: str, group: str):
    """(process group or None, group size, this rank's index in the group)."""
    try:
        pg = resolve_group(group)
    except CollectiveError:
        raise
    except FxparError as e:
        raise CollectiveError(str(e), op=op, group=group) from e
    if pg is None:
        return None, 1, 0
    return pg, pg.size(), dist.get_rank(pg)


def _backend_of(pg, device: torch.device) -> str:
    """The backend that runs collectives on ``device`` tensors: "gloo", "nccl", ... ("" if unknown)."""
    try:
        name = str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):
        return ""
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)  # "cpu:gloo,cuda:nccl"
    return by_device.get(device.type, "")


def _communicate(op: str, group: str, x: torch.Tensor, launch: Callable[[], object]) -> None:
    """Start a collective (``launch`` returns its work handle) and wait for it. ``Work.wait()`` with no
    argument waits at most the process group's timeout (gloo raises; NCCL's watchdog aborts the
    communicator), so no call waits for ever. Errors name the op, group and shape."""
    try:
        work = launch()
        if work is not None:
            work.wait()
    except RuntimeError as e:  # DistBackendError and gloo's timeouts are RuntimeErrors
        raise CollectiveError(
            f"the collective failed or timed out (input shape {tuple(x.shape)}, dtype {x.dtype}, "
            f"rank {dist.get_rank()} of the world; the wait is bounded by the process group's timeout): {e}",
            op=op, group=group, sizes=[tuple(x.shape)],
        ) from e


def _cross_check(op: str, group: str, pg, x: torch.Tensor) -> None:
    """With shape checks on: every rank of the group must bring the same shape and dtype."""
    if not _SHAPE_CHECKS:
        return
    mine = (tuple(x.shape), str(x.dtype))
    seen: list = [None] * pg.size()
    _communicate(op, group, x, lambda: dist.all_gather_object(seen, mine, group=pg))
    if any(s != mine for s in seen):
        listing = ", ".join(f"rank {r}: {s[0]} {s[1]}" for r, s in enumerate(seen))
        raise CollectiveError(f"the ranks' inputs differ ({listing}); every rank must pass the same shape",
                              op=op, group=group, sizes=[s[0] for s in seen])


# all_gather_single / reduce_scatter_single are the names since torch 2.13; older releases (our floor
# is 2.6) call them all_gather_into_tensor / reduce_scatter_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = _all_gather_single  # torch's single-tensor all-gather under its current name


def _copy(x: torch.Tensor) -> torch.Tensor:
    # A custom op may not return (a view of) its input, so the one-rank case still copies.
    return x.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------------
# The ops: real kernels


@torch.library.custom_op("fxpar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over ``group`` ("sum", "avg", "max" or "min"); every rank gets the result.
    Backward: identity for "sum" (the gradient is already replicated), divided by the group size for
    "avg", none for "max"/"min"."""
    _check_reduce_op("all_reduce", group, op, x)
    pg, n, _ = _membership("all_reduce", group)
    out = _copy(x)
    if n == 1 or x.numel() == 0:
        return out
    _cross_check("all_reduce", group, pg, x)
    # "avg" is a sum then a division on every backend: one code path, and older gloo rejects ReduceOp.AVG.
    red = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
           "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    _communicate("all_reduce", group, x, lambda: dist.all_reduce(out, op=red, group=pg, async_op=True))
    if op == "avg":
        out.div_(n)
    return out


@torch.library.custom_op("fxpar::identity_fwd_all_reduce_bwd", mutates_args=())
def identity_fwd_all_reduce_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity (a copy); backward: all-reduce sum of the gradient over ``group``."""
    return _copy(x)


def _gather_impl(op: str, x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    d = _norm_dim(op, group, x, dim)
    pg, n, _ = _membership(op, group)
    if n == 1:
        return _copy(x)
    _cross_check(op, group, pg, x)
    # The single-tensor all-gather concatenates along dim 0: bring dim to the front, gather, move back.
    front = x.movedim(d, 0).contiguous()
    buf = front.new_empty((n * front.shape[0], *front.shape[1:]))
    if x.numel():
        _communicate(op, group, x, lambda: _all_gather_single(buf, front, group=pg, async_op=True))
    return buf.movedim(0, d).contiguous()


@torch.library.custom_op("fxpar::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` in group-rank order (dim grows ``group size`` times).
    Backward: this rank's slice of the (replicated) gradient."""
    return _gather_impl("all_gather", x, group, dim)


@torch.library.custom_op("fxpar::all_gather_rs_bwd", mutates_args=())
def all_gather_rs_bwd(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """As :func:`all_gather`, but the gradient reaching it is a per-rank partial sum (sequence
    parallel, ZeRO-3), so its backward is a reduce-scatter."""
    return _gather_impl("all_gather_rs_bwd", x, group, dim)


# set by fxpar.runtime.data_parallel while a ZeRO-3 forward runs: told of every gathered parameter bucket,
# so that autograd saves a handle instead of the gathered tensor and gathers again in backward
param_gather_observer = None


@torch.library.custom_op("fxpar::gather_params", mutates_args=())
def gather_params(x: torch.Tensor, group: str, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """ZeRO-3: this rank's shard of a flat parameter bucket, gathered to the full bucket along ``dim``
    (cast to ``dtype`` first when given: mixed precision communicates and computes in bf16).
    Backward: reduce-scatter of the gradient in the shard's own dtype (fp32 master weights: fp32
    reductions), each rank keeping the summed gradient of its shard."""
    out = _gather_impl("gather_params", x if dtype is None else x.to(dtype), group, dim)
    if param_gather_observer is not None:
        param_gather_observer(out, x, group, dim, dtype)
    return out


def gather_params_op():
    return torch.ops.fxpar.gather_params.default


@torch.library.custom_op("fxpar::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's slice along ``dim`` (dim shrinks ``group size``
    times). Backward: all-gather of the gradient along ``dim``."""
    d = _norm_dim("reduce_scatter", group, x, dim)
    pg, n, rank = _membership("reduce_scatter", group)
    k = _shard_len("reduce_scatter", group, x, d, n)
    if n == 1:
        return _copy(x)
    _cross_check("reduce_scatter", group, pg, x)
    if _backend_of(pg, x.device) == "gloo":
        # Gloo has no reduce-scatter algorithm of its own: where a torch release offers a single-tensor
        # reduce-scatter on gloo at all, it is an all-reduce followed by taking this rank's chunk (twice
        # the traffic of a ring reduce-scatter; pytorch PR #118911), and older gloo had none. Doing the
        # all-reduce + slice here costs the same, is one code path on every torch we support, and keeps
        # the 2x visible where it happens. Gloo is our CPU test backend, so the traffic does not matter.
        full = _copy(x)
        if x.numel():
            _communicate("reduce_scatter", group, x,
                         lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=pg, async_op=True))
        return full.narrow(d, rank * k, k).contiguous()
    # Native path (NCCL, ...): the single-tensor reduce-scatter splits along dim 0.
    front = x.movedim(d, 0).contiguous()
    out = front.new_empty((k, *front.shape[1:]))
    if x.numel():
        _communicate("reduce_scatter", group, x,
                     lambda: _reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=pg, async_op=True))
    return out.movedim(0, d).contiguous()


@torch.library.custom_op("fxpar::scatter_slice", mutates_args=())
def scatter_slice(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of a tensor replicated over ``group`` (no communication).
    Backward: all-gather of the gradient along ``dim``."""
    d = _norm_dim("scatter_slice", group, x, dim)
    _, n, rank = _membership("scatter_slice", group)
    k = _shard_len("scatter_slice", group, x, d, n)
    return _copy(x.narrow(d, rank * k, k))


# ---------------------------------------------------------------------------------------------------
# Fake kernels: shapes only (FakeTensorMode, meta tensors, torch.export, make_fx)


def _fake_size(op: str, group: str) -> int:
    try:
        return group_size(group)
    except CollectiveError:
        raise
    except FxparError as e:
        raise CollectiveError(str(e), op=op, group=group) from e


def _resized(x: torch.Tensor, dim: int, size) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


@all_reduce.register_fake
def _all_reduce_fake(x, group, op="sum"):
    _check_reduce_op("all_reduce", group, op, x)
    return x.new_empty(x.shape)


@identity_fwd_all_reduce_bwd.register_fake
def _identity_fake(x, group):
    return x.new_empty(x.shape)


def _gather_fake(op: str):
    def fake(x, group, dim):
        d = _norm_dim(op, group, x, dim)
        return _resized(x, d, x.shape[d] * _fake_size(op, group))
    return fake


all_gather.register_fake(_gather_fake("all_gather"))
all_gather_rs_bwd.register_fake(_gather_fake("all_gather_rs_bwd"))
@gather_params.register_fake
def _gather_params_fake(x, group, dim, dtype=None):
    out = _gather_fake("gather_params")(x, group, dim)
    return out if dtype is None else out.to(dtype)


def _scatter_fake(op: str):
    def fake(x, group, dim):
        d = _norm_dim(op, group, x, dim)
        return _resized(x, d, _shard_len(op, group, x, d, _fake_size(op, group)))
    return fake


reduce_scatter.register_fake(_scatter_fake("reduce_scatter"))
scatter_slice.register_fake(_scatter_fake("scatter_slice"))


# ---------------------------------------------------------------------------------------------------
# Autograd: every backward is itself made of fxpar ops (differentiable, visible in traced backwards)


def _save_group_dim(ctx, inputs, output):
    ctx.group, ctx.dim = inputs[1], inputs[2]


def _save_all_reduce(ctx, inputs, output):
    group = inputs[1]
    ctx.group = group
    ctx.op = inputs[2] if len(inputs) > 2 else "sum"
    ctx.n = group_size(group) if ctx.op == "avg" else 1


def _all_reduce_bwd(ctx, grad):
    if ctx.op == "sum":
        return grad, None, None
    if ctx.op == "avg":
        return grad / ctx.n, None, None
    raise CollectiveError(f"all_reduce with op={ctx.op!r} has no gradient", op="all_reduce", group=ctx.group)


def _identity_save(ctx, inputs, output):
    ctx.group = inputs[1]


def _identity_bwd(ctx, grad):
    return all_reduce(grad, ctx.group, "sum"), None


def _backward_with(fn):
    def backward(ctx, grad):
        return fn(grad, ctx.group, ctx.dim), None, None
    return backward


all_reduce.register_autograd(_all_reduce_bwd, setup_context=_save_all_reduce)
identity_fwd_all_reduce_bwd.register_autograd(_identity_bwd, setup_context=_identity_save)
all_gather.register_autograd(_backward_with(scatter_slice), setup_context=_save_group_dim)
all_gather_rs_bwd.register_autograd(_backward_with(reduce_scatter), setup_context=_save_group_dim)
def _gather_params_save(ctx, inputs, output):
    ctx.group, ctx.dim, ctx.dtype = inputs[1], inputs[2], inputs[0].dtype


def _gather_params_bwd(ctx, grad):
    return reduce_scatter(grad.to(ctx.dtype), ctx.group, ctx.dim), None, None, None


gather_params.register_autograd(_gather_params_bwd, setup_context=_gather_params_save)
reduce_scatter.register_autograd(_backward_with(all_gather), setup_context=_save_group_dim)
scatter_slice.register_autograd(_backward_with(all_gather), setup_context=_save_group_dim)


# ---------------------------------------------------------------------------------------------------
# Graph analysis


def collective_kind(node: torch.fx.Node) -> str | None:
    """The fxpar op a node calls ("all_reduce", ...), or None."""
    if node.op != "call_function":
        return None
    packet = getattr(node.target, "overloadpacket", node.target)  # OpOverload -> its packet
    qualified = getattr(packet, "_qualified_op_name", "")
    namespace, _, name = qualified.partition("::")
    return name if namespace == "fxpar" and name in COLLECTIVE_OPS else None


def _collective_nodes(gm):
    """(kind, node) for every fxpar op node of ``gm`` and of the graph modules it holds (bodies of
    higher-order ops), each counted where it stands in the code, not per execution."""
    modules = [gm] if isinstance(gm, torch.fx.Graph) else [m for m in gm.modules()
                                                            if isinstance(m, torch.fx.GraphModule)]
    for m in modules:
        graph = m if isinstance(m, torch.fx.Graph) else m.graph
        for node in graph.nodes:
            kind = collective_kind(node)
            if kind is not None:
                yield kind, node


def count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many nodes of each fxpar op the graph has (every op in :data:`COLLECTIVE_OPS`, zeros included)."""
    counts = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, _ in _collective_nodes(gm):
        counts[kind] += 1
    return counts


def _node_arg(node: torch.fx.Node, index: int, name: str):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _int(v) -> int:
    if isinstance(v, torch.SymInt):
        hint = v.node.hint
        if hint is None:
            raise FxparError(f"a symbolic size without a hint ({v}) cannot be costed")
        return int(hint)
    return int(v)


def _nbytes(val) -> int | None:
    if not isinstance(val, torch.Tensor):
        return None
    return _int(val.numel()) * val.element_size()


def _full_bytes(kind: str, node: torch.fx.Node) -> int:
    """Bytes of the full (unsharded) tensor the node's collective works on: the larger of its input
    and its output, whichever of the two ``meta["val"]`` holds."""
    src = node.args[0] if node.args else None
    in_b = _nbytes(src.meta.get("val")) if isinstance(src, torch.fx.Node) else None
    out_b = _nbytes(node.meta.get("val"))
    if in_b is None and out_b is None:
        raise FxparError(
            f"node {node.name} ({kind}) has no meta['val'] on it or its input; trace with torch.export / "
            "make_fx or run FakeTensorProp first"
        )
    if in_b is not None and out_b is not None:
        return max(in_b, out_b)
    n = group_size(_node_arg(node, 1, "group"))
    if in_b is not None:
        return in_b * n if kind in ("all_gather", "all_gather_rs_bwd", "gather_params") else in_b
    return out_b * n if kind in ("reduce_scatter", "scatter_slice") else out_b


def collective_events(gm: torch.fx.GraphModule) -> list[dict]:
    """Every fxpar op node with what it communicates: ``{"node", "kind", "module", "forward", "backward",
    "bytes"}`` where forward/backward name the collective each direction runs (None: none) and bytes
    is the full tensor's payload (as :func:`collective_bytes` counts it)."""
    out = []
    for kind, node in _collective_nodes(gm):
        fwd, bwd = _COMMS[kind]
        out.append({"node": node.name, "kind": kind, "module": node.meta.get("fxpar.module", ""), "forward": fwd,
                    "backward": bwd, "bytes": _full_bytes(kind, node) if fwd or bwd else 0})
    return out


def collective_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """Raw payload bytes per fxpar op, summed over its nodes: the size of the full (unsharded) tensor
    each collective works on (the all-reduced tensor, the gathered output, the reduce-scattered input),
    whatever the algorithm. Ops whose forward does not communicate (``identity_fwd_all_reduce_bwd``,
    ``scatter_slice``) count 0. ``backward=True`` gives instead the payload of the collectives each
    node's backward will run (for a forward graph whose backward autograd derives from the ops)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in _collective_nodes(gm):
        comm = _COMMS[kind][1 if backward else 0]
        if comm is not None:
            out[kind] += _full_bytes(kind, node) * len(comm.split("+"))
    return out


def ring_bytes(comm: str, payload: int, n: int) -> int:
    """Bytes each rank sends for a collective of ``payload`` (full-tensor) bytes over ``n`` ranks
    with a ring algorithm: all-reduce ``2(n-1)/n * payload``, all-gather and reduce-scatter
    ``(n-1)/n * payload`` (rounded down)."""
    if comm == "all_reduce":
        return 2 * (n - 1) * payload // n
    if comm in ("all_gather", "reduce_scatter"):
        return (n - 1) * payload // n
    raise FxparError(f"unknown communication {comm!r}; use all_reduce, all_gather or reduce_scatter")


def collective_ring_bytes(gm: torch.fx.GraphModule, *, backward: bool = False) -> dict[str, int]:
    """As :func:`collective_bytes`, converted with :func:`ring_bytes` into bytes each rank sends,
    using each node's group size (:func:`group_size` of its group name)."""
    out = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, node in _collective_nodes(gm):
        comm = _COMMS[kind][1 if backward else 0]
        if comm is not None:
            n = group_size(_node_arg(node, 1, "group"))
            out[kind] += sum(ring_bytes(c, _full_bytes(kind, node), n) for c in comm.split("+"))
    return out
