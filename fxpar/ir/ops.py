"""The collective ops of fxpar's IR: ``torch.ops.fxpar.*`` schemas, fake kernels and autograd formulas,
made from the records of :mod:`fxpar.ir.collectives`.

Reads: the records (:data:`~fxpar.ir.collectives.COLLECTIVES`) at import; group names, when an op is
traced. Writes: the ``fxpar`` op namespace of torch's dispatcher (schemas, fake/meta kernels, autograd
formulas), one op per record (:func:`define`, looped over the records; nothing here names an op but the
module attributes that keep the public names, ``fxpar.ir.ops.all_gather`` ...).

Why here and not in the runtime: passes insert these ops, the cost model counts them and tracing runs
them on fake tensors, none of which needs a process group. So the schemas live in the vocabulary
layer (importable without torch.distributed being initialised, and without the runtime), and the
real kernels are registered by :mod:`fxpar.runtime.collectives`. Until it is imported, running an op
on real tensors raises a :class:`CollectiveError` saying so.

Design, in short:

* Each collective is a functional ``torch.library`` custom op (namespace ``fxpar``; it returns a new
  tensor, never mutates or aliases its input), so it is an ordinary node of an ATen graph: torch.export,
  make_fx and FakeTensorMode trace it through its fake kernel, and passes can count, bucket and reorder
  it. Its backward formula is written with fxpar ops too (the record's ``grad`` op, or its ``grad_hook``),
  so a traced backward shows its collectives.
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

from fxpar.ir.collectives import COLLECTIVES, Collective, fused_collectives
from fxpar.ir.errors import CollectiveError, FxparError
from fxpar.ir.wire import check_comm_dtype

__all__ = [
    "COLLECTIVE_OPS",
    "FUSED_COLLECTIVES",
    "OPS",
    "REDUCE_OPS",
    "all_gather",
    "all_gather_rs_bwd",
    "all_reduce",
    "all_to_all",
    "collective_kind",
    "collective_nodes",
    "count_collectives",
    "default_group_size",
    "define",
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
COLLECTIVE_OPS = tuple(name for name, c in COLLECTIVES.items() if c.counted)

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
# The ops, made from their records. Their bodies are the kernels used until fxpar.runtime.collectives
# registers the real ones.


class Signature:
    """The argument names and defaults of a record's ``schema``, as torch parses it."""

    def __init__(self, schema: str):
        parsed = torch._C.parse_schema(f"fxpar::_({schema}) -> Tensor")
        self.names = tuple(a.name for a in parsed.arguments)
        self.defaults = {a.name: a.default_value for a in parsed.arguments if a.has_default_value()}

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """Every argument in schema order, defaults filled in."""
        rest = self.names[len(args):]
        return (*args, *(kwargs[n] if n in kwargs else self.defaults[n] for n in rest))

    def named(self, values: tuple) -> dict:
        """The arguments after the tensor, by name."""
        return dict(zip(self.names[1:], values[1:]))


# name -> the op defined from its record, and its signature (define writes both, once per op): a per-process
# registry, as torch's dispatcher that holds the ops is; the runtime reads it to register the kernels
OPS: dict[str, torch._library.custom_ops.CustomOpDef] = {}
SIGNATURES: dict[str, Signature] = {}


def _no_kernel(op: str, group: str) -> torch.Tensor:
    raise CollectiveError("no kernel is registered for real tensors in this process; importing "
                          "fxpar.runtime.collectives registers them", op=op, group=group)


def _placeholder(rec: Collective, sig: Signature):
    def body(*args, **kwargs):
        return _no_kernel(rec.name, sig.named(sig.bind(args, kwargs))["group"])
    return body


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


def _shaped(rec: Collective, x: torch.Tensor, group: str, dim: int) -> torch.Tensor:
    """The output of ``rec``'s op on ``x`` by its record's shape rule (:class:`fxpar.ir.collectives.Collective`)."""
    if rec.shape == "same":
        return x.new_empty(x.shape)
    d = check_dim(rec.name, group, x, dim)
    n = _fake_size(rec.name, group)
    return _resized(x, d, x.shape[d] * n if rec.shape == "gather" else shard_len(rec.name, group, x, d, n))


def _fake(rec: Collective, sig: Signature):
    """Shapes only (FakeTensorMode, meta tensors, torch.export, make_fx), after the record's local checks."""
    def fake(*args, **kwargs):
        values = sig.bind(args, kwargs)
        x, named = values[0], sig.named(values)
        x = x if rec.prepare is None else rec.prepare(x)
        group = named["group"]
        if rec.reduce_arg is not None:
            check_reduce_op(rec.name, group, values[rec.reduce_arg], x)
        if rec.comm_dtype_arg is not None:
            check_comm_dtype(rec.name, group, values[rec.comm_dtype_arg], rec.comm_dtypes)
        if rec.check is not None:
            rec.check(rec.name, group, x, named, group_size(group))
        out = _shaped(rec, x, group, named.get("dim", 0))
        dtype = None if rec.cast_arg is None else values[rec.cast_arg]
        return out if dtype is None else out.to(dtype)
    return fake


def _setup(ctx, inputs, output):
    ctx.values, ctx.x_dtype = inputs[1:], inputs[0].dtype


def _backward(rec: Collective, sig: Signature):
    """The record's gradient, itself made of fxpar ops (differentiable, visible in traced backwards)."""
    def backward(ctx, grad):
        named = dict(zip(sig.names[1:], ctx.values))
        if rec.grad_hook is not None:
            return rec.grad_hook(grad, ctx.x_dtype, named, group_size), *(None,) * len(ctx.values)
        given = {**named, **dict(rec.grad_args)}
        call = [grad]
        for name in SIGNATURES[rec.grad].names[1:]:  # the gradient op's arguments, up to the first not given
            if name not in given:
                break
            call.append(given[name])
        return OPS[rec.grad](*call), *(None,) * len(ctx.values)
    return backward


def define(rec: Collective):
    """Define ``torch.ops.fxpar.<rec.name>`` from its record: the schema, a kernel raising until the runtime
    registers the real one, the fake kernel, the autograd formula. Returns the op (a ``torch.library``
    custom op; the module attributes below are these). A record's ``grad`` names a record of
    :data:`~fxpar.ir.collectives.COLLECTIVES` or an op defined before."""
    if rec.grad is not None and rec.grad not in OPS and rec.grad not in COLLECTIVES:
        raise FxparError(f"collective {rec.name!r}: its gradient op {rec.grad!r} is neither a record of "
                         "fxpar.ir.collectives.COLLECTIVES nor defined; define it first")
    sig = Signature(rec.schema)
    op = torch.library.custom_op(f"fxpar::{rec.name}", _placeholder(rec, sig), mutates_args=(),
                                 schema=f"({rec.schema}) -> Tensor")
    op.register_fake(_fake(rec, sig))
    if rec.grad is not None or rec.grad_hook is not None:
        op.register_autograd(_backward(rec, sig), setup_context=_setup)
    op.__doc__ = rec.doc
    OPS[rec.name], SIGNATURES[rec.name] = op, sig
    return op


for _rec in COLLECTIVES.values():
    define(_rec)

all_reduce = OPS["all_reduce"]
identity_fwd_all_reduce_bwd = OPS["identity_fwd_all_reduce_bwd"]
all_gather = OPS["all_gather"]
all_gather_rs_bwd = OPS["all_gather_rs_bwd"]
gather_params = OPS["gather_params"]
reduce_scatter = OPS["reduce_scatter"]
scatter_slice = OPS["scatter_slice"]
all_to_all = OPS["all_to_all"]


def gather_params_op():
    return torch.ops.fxpar.gather_params.default


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
