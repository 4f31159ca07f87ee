"""The collective ops of fxpar's IR: ``torch.ops.fxpar.*`` schemas, fake kernels and autograd formulas.

Reads: nothing at import but torch; group names, when an op is traced. Writes: the ``fxpar`` op
namespace of torch's dispatcher (schemas, fake/meta kernels, autograd formulas).

Why here and not in the runtime: passes insert these ops, the cost model counts them and tracing runs
them on fake tensors, none of which needs a process group. So the schemas live in the vocabulary
layer (importable without torch.distributed being initialised, and without the runtime), and the
real kernels are registered by :mod:`fxpar.runtime.collectives`. Until it is imported, running an op
on real tensors raises a :class:`CollectiveError` saying so.

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
* A group is named by a string. The compiler writes names that list their ranks,
  ``"label:r0,r1,..."`` (:meth:`fxpar.ir.mesh.MeshSpec.group_name`, e.g. ``"tp:0,1"``): the name is
  the group's identity and carries its size, which is all a fake kernel needs, so a program can be
  traced for a group that does not exist. Other names (``"world"``, or a label such as ``"tp"`` that
  a test registers by hand) are sized by their registration in :data:`REGISTERED_GROUPS`, the table
  :func:`fxpar.runtime.groups.register_group` writes; an unregistered one has the world's size for
  ``"world"``, else one rank while torch.distributed is not initialised.
* Quantized communication (ZeRO++, ``Plan(comm_dtype="int8")``) is a ``comm_dtype`` argument of
  ``gather_params`` and ``reduce_scatter``, not an op of its own: :mod:`fxpar.ir.wire`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.fx

from fxpar.ir.collectives import COLLECTIVES, collective, fused_collectives
from fxpar.ir.errors import CollectiveError, FxparError
from fxpar.ir.wire import GATHER_COMM_DTYPES, REDUCE_SCATTER_COMM_DTYPES, check_comm_dtype

__all__ = [
    "COLLECTIVE_OPS",
    "FUSED_COLLECTIVES",
    "REDUCE_OPS",
    "all_gather",
    "all_gather_rs_bwd",
    "all_reduce",
    "collective_kind",
    "collective_nodes",
    "count_collectives",
    "default_group_size",
    "gather_params",
    "gather_params_op",
    "group_size",
    "group_size_from_name",
    "identity_fwd_all_reduce_bwd",
    "parse_ranks",
    "reduce_scatter",
    "scatter_slice",
]

# Every op of the namespace, in a fixed order (the keys of count_collectives and the byte counts):
# one record each in fxpar.ir.collectives
COLLECTIVE_OPS = tuple(COLLECTIVES)

REDUCE_OPS = ("sum", "avg", "max", "min")
# fused kernels that run one of these ops inside (fxpar.ir.collective_matmul_ops): counted as that op
FUSED_COLLECTIVES = fused_collectives()


# ---------------------------------------------------------------------------------------------------
# Group names and sizes


def dist_up() -> bool:
    """Whether torch.distributed is available and initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def parse_ranks(name: str) -> tuple[int, ...] | None:
    """The ranks a ``"label:r0,r1,..."`` name lists, else None."""
    _, sep, tail = name.rpartition(":")
    if not sep or not tail:
        return None
    try:
        ranks = tuple(int(r) for r in tail.split(","))
    except ValueError:
        return None
    return ranks if len(set(ranks)) == len(ranks) and min(ranks) >= 0 else None


def group_size_from_name(name: str) -> int | None:
    """How many ranks a ``"label:r0,r1,..."`` name lists (``"tp:0,1"`` -> 2), else None."""
    ranks = parse_ranks(name)
    return None if ranks is None else len(ranks)


def default_group_size(name: str, registered=()) -> int:
    """The size of group ``name`` without a registration: the world for ``"world"``, else what the name
    lists, else 1 when torch.distributed is not initialised. Raises :class:`FxparError` for any other
    name (``registered``: the names the runtime's registry knows, for the message)."""
    if name == "world":
        return dist.get_world_size() if dist_up() else 1
    size = group_size_from_name(name)
    if size is not None:
        return size
    if not dist_up():
        return 1
    raise FxparError(
        f"unknown process group {name!r} (registered: {sorted(registered) or 'none'}); "
        "register it with fxpar.runtime.groups.register_group or create it with new_group"
    )


# This process's table of registered group names -> entries with a ``size`` (fxpar.runtime.groups'
# registry writes it; it holds it as its own table). Per process, because torch's custom-op machinery calls
# a fake kernel with the op's arguments only (a tensor and the group's name): the size of a hand-registered
# name ("tp", "dp") can come from nowhere else, as c10d keeps torch's own process groups by name per process.
REGISTERED_GROUPS: dict = {}


def group_size(name: str) -> int:
    """How many ranks group ``name`` has: its registration, else :func:`default_group_size`."""
    g = REGISTERED_GROUPS.get(name)
    return g.size if g is not None else default_group_size(name, registered=REGISTERED_GROUPS)


# ---------------------------------------------------------------------------------------------------
# Local checks (shared by the fake kernels here and the real ones in fxpar.runtime.collectives)


def check_dim(op: str, group: str, x: torch.Tensor, dim: int) -> int:
    """``dim`` normalised to ``[0, x.dim())``, raising if it is out of range."""
    nd = x.dim()
    if not -nd <= dim < nd:
        raise CollectiveError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}",
                              op=op, group=group, sizes=[tuple(x.shape)])
    return dim % nd


def shard_len(op: str, group: str, x: torch.Tensor, dim: int, n: int) -> int:
    """x.shape[dim] // n, raising unless n divides it."""
    size = x.shape[dim]
    if size % n:
        raise CollectiveError(
            f"dim {dim} has size {size}, which does not split into {n} equal shards "
            f"(input shape {tuple(x.shape)}, group size {n})",
            op=op, group=group, sizes=[tuple(x.shape)],
        )
    return size // n


def check_reduce_op(op: str, group: str, reduce_op: str, x: torch.Tensor) -> None:
    if reduce_op not in REDUCE_OPS:
        raise CollectiveError(f"unknown reduction {reduce_op!r}; use one of {REDUCE_OPS}", op=op, group=group)
    if reduce_op == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise CollectiveError(f"'avg' needs a floating tensor, got {x.dtype}", op=op, group=group)


# ---------------------------------------------------------------------------------------------------
# The ops. Their bodies are the kernels used until fxpar.runtime.collectives registers the real ones.


def _no_kernel(op: str, group: str) -> torch.Tensor:
    raise CollectiveError("no kernel is registered for real tensors in this process; importing "
                          "fxpar.runtime.collectives registers them", op=op, group=group)


@torch.library.custom_op("fxpar::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over ``group`` ("sum", "avg", "max" or "min"); every rank gets the result.
    Backward: identity for "sum" (the gradient is already replicated), divided by the group size for
    "avg", none for "max"/"min"."""
    return _no_kernel("all_reduce", group)


@torch.library.custom_op("fxpar::identity_fwd_all_reduce_bwd", mutates_args=())
def identity_fwd_all_reduce_bwd(x: torch.Tensor, group: str) -> torch.Tensor:
    """Identity (a copy); backward: all-reduce sum of the gradient over ``group``."""
    return _no_kernel("identity_fwd_all_reduce_bwd", group)


@torch.library.custom_op("fxpar::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` in group-rank order (dim grows ``group size`` times).
    Backward: this rank's slice of the (replicated) gradient."""
    return _no_kernel("all_gather", group)


@torch.library.custom_op("fxpar::all_gather_rs_bwd", mutates_args=())
def all_gather_rs_bwd(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """As :func:`all_gather`, but the gradient reaching it is a per-rank partial sum (sequence
    parallel, ZeRO-3), so its backward is a reduce-scatter."""
    return _no_kernel("all_gather_rs_bwd", group)


@torch.library.custom_op("fxpar::gather_params", mutates_args=())
def gather_params(x: torch.Tensor, group: str, dim: int, dtype: torch.dtype | None = None,
                  comm_dtype: str | None = None) -> torch.Tensor:
    """ZeRO-3: this rank's shard of a flat parameter bucket, gathered to the full bucket along ``dim``
    (cast to ``dtype`` first when given: mixed precision communicates and computes in bf16), sent in
    the wire format ``comm_dtype`` (:mod:`fxpar.ir.wire`). Backward: reduce-scatter of the gradient in
    the shard's own dtype (fp32 master weights: fp32 reductions), each rank keeping its shard's sum."""
    return _no_kernel("gather_params", group)


def gather_params_op():
    return torch.ops.fxpar.gather_params.default


@torch.library.custom_op("fxpar::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group: str, dim: int, comm_dtype: str | None = None) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's slice along ``dim`` (dim shrinks ``group size``
    times), sent in the wire format ``comm_dtype`` (:mod:`fxpar.ir.wire`). Backward: all-gather."""
    return _no_kernel("reduce_scatter", group)


@torch.library.custom_op("fxpar::scatter_slice", mutates_args=())
def scatter_slice(x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """This rank's slice along ``dim`` of a tensor replicated over ``group`` (no communication).
    Backward: all-gather of the gradient along ``dim``."""
    return _no_kernel("scatter_slice", group)


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


def _shaped(op: str, x: torch.Tensor, group: str, dim: int | None = None) -> torch.Tensor:
    """The output of op ``op`` on ``x`` by its record's shape rule (:class:`fxpar.ir.collectives.Collective`)."""
    shape = collective(op).shape
    if shape == "same":
        return x.new_empty(x.shape)
    d = check_dim(op, group, x, dim)
    n = _fake_size(op, group)
    return _resized(x, d, x.shape[d] * n if shape == "gather" else shard_len(op, group, x, d, n))


@all_reduce.register_fake
def _all_reduce_fake(x, group, op="sum"):
    check_reduce_op("all_reduce", group, op, x)
    return _shaped("all_reduce", x, group)


@identity_fwd_all_reduce_bwd.register_fake
def _identity_fake(x, group):
    return _shaped("identity_fwd_all_reduce_bwd", x, group)


def _fake(op: str):
    def fake(x, group, dim):
        return _shaped(op, x, group, dim)
    return fake


for _op in ("all_gather", "all_gather_rs_bwd", "scatter_slice"):
    torch.library.register_fake(f"fxpar::{_op}", _fake(_op))


@gather_params.register_fake
def _gather_params_fake(x, group, dim, dtype=None, comm_dtype=None):
    check_comm_dtype("gather_params", group, comm_dtype, GATHER_COMM_DTYPES)
    out = _shaped("gather_params", x, group, dim)
    return out if dtype is None else out.to(dtype)


@reduce_scatter.register_fake
def _reduce_scatter_fake(x, group, dim, comm_dtype=None):
    check_comm_dtype("reduce_scatter", group, comm_dtype, REDUCE_SCATTER_COMM_DTYPES)
    return _shaped("reduce_scatter", x, group, dim)


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


def _backward_with(fn, extra: int = 0):  # extra: optional arguments after (x, group, dim)
    def backward(ctx, grad):
        return fn(grad, ctx.group, ctx.dim), None, None, *(None,) * extra
    return backward


def _gather_params_save(ctx, inputs, output):
    ctx.group, ctx.dim, ctx.dtype = inputs[1], inputs[2], inputs[0].dtype
    ctx.quantized = len(inputs) > 4 and inputs[4] == "int8+grads"


def _gather_params_bwd(ctx, grad):  # 3 arguments unless quantized: the node every other pass knows
    args = (grad.to(ctx.dtype), ctx.group, ctx.dim) + (("int8",) if ctx.quantized else ())
    return reduce_scatter(*args), None, None, None, None


all_reduce.register_autograd(_all_reduce_bwd, setup_context=_save_all_reduce)
identity_fwd_all_reduce_bwd.register_autograd(_identity_bwd, setup_context=_identity_save)
all_gather.register_autograd(_backward_with(scatter_slice), setup_context=_save_group_dim)
all_gather_rs_bwd.register_autograd(_backward_with(reduce_scatter), setup_context=_save_group_dim)
gather_params.register_autograd(_gather_params_bwd, setup_context=_gather_params_save)
reduce_scatter.register_autograd(_backward_with(all_gather, 1), setup_context=_save_group_dim)
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


def collective_nodes(gm) -> Iterator[tuple[str, torch.fx.Node]]:
    """(kind, node) for every fxpar op node of ``gm`` (a GraphModule or a Graph) and of the graph
    modules it holds (bodies of higher-order ops), each counted where it stands in the code, not per
    execution."""
    modules = [gm] if isinstance(gm, torch.fx.Graph) else [m for m in gm.modules()
                                                            if isinstance(m, torch.fx.GraphModule)]
    for m in modules:
        graph = m if isinstance(m, torch.fx.Graph) else m.graph
        for node in graph.nodes:
            fused = getattr(getattr(node.target, "overloadpacket", None), "_qualified_op_name", "")
            kind = collective_kind(node) or FUSED_COLLECTIVES.get(fused)
            if kind is not None:
                yield kind, node


def count_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many nodes of each fxpar op the graph has (every op in :data:`COLLECTIVE_OPS`, zeros included)."""
    counts = dict.fromkeys(COLLECTIVE_OPS, 0)
    for kind, _ in collective_nodes(gm):
        counts[kind] += 1
    return counts
