"""The one record of every collective: what each communication pattern costs on a ring, and what each
``torch.ops.fxpar`` collective op takes, communicates, how its fake kernel shapes its output, what its
gradient is, which of the runtime's communication patterns runs it and what the lowering turns it into.

Reads: nothing. Writes nothing (two tables, built at import).

Who reads it: :mod:`fxpar.ir.ops` (defines every op from its record: the ``torch.library`` schema, the fake
kernel, the autograd formula; the op list, the fused kernels counted as a collective),
:mod:`fxpar.runtime.collectives` (registers each op's eager kernel: the implementation of its record's
``kernel`` pattern, written once per pattern), :mod:`fxpar.cost.comm` (``RING``, ``KINDS``, ``COMMS``: bytes
and ring shares), :mod:`fxpar.passes.lower_collectives` (the functional collective each op lowers to, where
its wire format argument is), and the report through :mod:`fxpar.cost.comm` and
:data:`fxpar.ir.ops.COLLECTIVE_OPS`.

A new collective that communicates like an existing one is one :class:`Collective` entry of
:data:`COLLECTIVES` (plus its test): nothing else names it. A new communication pattern is one :class:`Comm`
entry (its ring cost) and, when ops run it, one name in :data:`PATTERNS` with its implementation in
:mod:`fxpar.runtime.collectives` (``tests/runtime/test_collectives.py`` checks that every pattern has one),
over its wire call keyed by the :class:`Comm`'s name in :data:`fxpar.runtime.dist_calls.WIRES`, the one module
that calls torch.distributed's collectives (``tests/test_collective_calls.py``).
What a record's fields cannot say is a hook on the record, a plain function here or in
:mod:`fxpar.ir.ep_layout`: ``all_reduce``'s gradient depends on its reduction, ``gather_params``' gradient
goes in its input's dtype and its wire format's gradient format, the expert-parallel all-to-alls take
their split sizes from a counts tensor, ``ep_counts`` gathers the counts its cumulative input gives and
tells the step's counters of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxpar.ir import ep_layout
from fxpar.ir.errors import CollectiveError
from fxpar.ir.wire import GATHER_COMM_DTYPES, REDUCE_SCATTER_COMM_DTYPES, wire_format

__all__ = ["COLLECTIVES", "COMMS", "PATTERNS", "Collective", "Comm", "collective", "fused_collectives"]


@dataclass(frozen=True)
class Comm:
    """A communication pattern on ``n`` ranks with a ring algorithm: ``ring(n)`` gives (steps of latency,
    and the share of the full tensor's bytes each rank sends as numerator, denominator)."""

    name: str
    ring: Callable[[int], tuple[int, int, int]]


def _ring(n: int) -> tuple[int, int, int]:
    return n - 1, n - 1, n


COMMS: dict[str, Comm] = {c.name: c for c in (
    Comm("all_reduce", lambda n: (2 * (n - 1), 2 * (n - 1), n)),
    Comm("all_gather", _ring),
    Comm("reduce_scatter", _ring),
    Comm("all_to_all", _ring),
    Comm("broadcast", _ring),
    Comm("send", lambda n: (1, 1, 1)),
)}

# The eager kernels the runtime implements, once each (fxpar.runtime.collectives): a record's ``kernel``.
# "identity" and "slice" communicate nothing; "all_to_all" moves rows with variable split sizes, which the
# record's ``route`` hook gives.
PATTERNS = ("all_reduce", "identity", "all_gather", "reduce_scatter", "slice", "all_to_all")


@dataclass(frozen=True)
class Collective:
    """One ``torch.ops.fxpar`` collective op.

    ``forward`` / ``backward``: the :data:`COMMS` patterns its forward and its backward run, in order (empty:
    none). ``shape``: its fake kernel's rule along ``dim`` (the ``dim`` argument, else dim 0): ``"same"``
    (the input's shape), ``"gather"`` (the dim grows group-size times) or ``"scatter"`` (it shrinks
    group-size times). ``lowering``: what :mod:`fxpar.passes.lower_collectives` turns it into: a
    ``torch.ops._c10d_functional`` op (``"all_reduce"``, ``"all_gather_into_tensor"``,
    ``"reduce_scatter_tensor"``, ``"all_to_all_single"`` of equal blocks), ``"slice"`` / ``"identity"``
    (local, no communication), or ``"opaque"`` (kept: it runs its own kernel).

    ``schema``: its arguments in ``torch.library`` syntax, the tensor first and the group's name second.
    ``kernel``: the :data:`PATTERNS` entry the runtime runs it with. ``grad``: the op its backward calls on
    the gradient, with the forward's arguments of the same names (positionally, up to the first it lacks)
    and ``grad_args`` set; ``grad_hook(grad, x_dtype, args, group_size)`` instead, where a rule needs more
    (``args``: the forward's arguments after the tensor, by name; ``group_size``:
    :func:`fxpar.ir.ops.group_size`, which this module cannot import); neither: no gradient. ``cast_arg``:
    the position of a dtype argument cast to before communicating (the gradient comes back in the input's
    dtype); ``comm_dtype_arg``: of the wire format argument (:mod:`fxpar.ir.wire`; a quantized node is not
    lowered), ``comm_dtypes`` the formats it takes; ``reduce_arg``: of the reduction's name ("sum", ...).
    ``check(op, group, x, args, n)``: a local check of the arguments (fake and real kernels);
    ``route(x, args, n, rank)``: the ``"all_to_all"`` pattern's rows, split sizes and output
    (:mod:`fxpar.ir.ep_layout`). ``prepare(x)``: what the ``"all_gather"`` pattern gathers instead of the
    input (fake and real kernels); ``tally(counters, out, args)``: what the active counters record of
    each output besides its bytes. ``counter``: the key under which the runtime counts the bytes each call
    sends off-rank (``_bwd`` appended when its ``backward`` argument is true) into the active counters;
    ``observed``: the runtime tells the current observer of each output (ZeRO-3's regathering).
    ``counted``: in :data:`fxpar.ir.ops.COLLECTIVE_OPS`, the graph counts and byte tables (the
    expert-parallel ops are counted by their own counters instead). ``fused``: the ``fxpar_kernels`` ops
    (:mod:`fxpar.ir.kernel_catalogue`) that run this op inside and count as it. ``doc``: the op's docstring.
    """

    name: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    shape: str
    lowering: str
    schema: str = "Tensor x, str group, SymInt dim"
    kernel: str = ""
    grad: str | None = None
    grad_args: tuple[tuple[str, object], ...] = ()
    grad_hook: Callable | None = None
    cast_arg: int | None = None
    comm_dtype_arg: int | None = None
    comm_dtypes: tuple = (None,)
    reduce_arg: int | None = None
    check: Callable | None = None
    route: Callable | None = None
    prepare: Callable | None = None
    tally: Callable | None = None
    counter: str | None = None
    observed: bool = False
    counted: bool = True
    fused: tuple[str, ...] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        unknown = [c for c in self.forward + self.backward if c not in COMMS]
        if unknown or self.shape not in ("same", "gather", "scatter") or self.kernel not in PATTERNS:
            raise ValueError(f"collective {self.name!r}: patterns {unknown} are not in COMMS, shape "
                             f"{self.shape!r} is not one of same/gather/scatter, or kernel {self.kernel!r} is "
                             f"not one of {PATTERNS}")
        if (self.kernel == "all_to_all") != (self.route is not None):
            raise ValueError(f"collective {self.name!r}: the all_to_all pattern needs a route, and only it")
        if self.kernel != "all_gather" and (self.prepare is not None or self.tally is not None):
            raise ValueError(f"collective {self.name!r}: only the all_gather pattern runs a prepare or tally hook")


# ---- hooks: what a record's fields cannot say -----------------------------------------------------

def _all_reduce_grad(grad: torch.Tensor, x_dtype, args: dict, group_size) -> torch.Tensor:
    """Identity for "sum" (the gradient is already replicated), divided by the group size for "avg", none
    for "max"/"min"."""
    if args["op"] == "sum":
        return grad
    if args["op"] == "avg":
        return grad / group_size(args["group"])
    raise CollectiveError(f"all_reduce with op={args['op']!r} has no gradient", op="all_reduce", group=args["group"])


def _gather_params_grad(grad: torch.Tensor, x_dtype, args: dict, group_size) -> torch.Tensor:
    """A reduce-scatter of the gradient in the shard's own dtype (fp32 master weights: fp32 reductions), in
    the wire format's gradient format if it has one; without one the node has 3 arguments, the node every
    other pass knows."""
    fmt = wire_format(args["comm_dtype"])
    quantized = () if fmt is None or fmt.grads is None else (fmt.grads,)
    return torch.ops.fxpar.reduce_scatter(grad.to(x_dtype), args["group"], args["dim"], *quantized)


def _check_blocks(op: str, group: str, x: torch.Tensor, args: dict, n: int) -> None:
    """``all_to_all``: dim 0 cuts into one equal block per rank."""
    if x.dim() == 0 or x.shape[0] % n:
        raise CollectiveError(f"cuts dim 0 into {n} equal blocks, one per rank; got shape {tuple(x.shape)}",
                              op=op, group=group)


def _block_route(x: torch.Tensor, args: dict, n: int, me: int):
    """``all_to_all``: block ``j`` of dim 0 to rank ``j``, one row each way; the received blocks, in rank
    order, make an output of ``x``'s shape."""
    return x.reshape(n, -1), [1] * n, [1] * n, lambda got: got.view(x.shape)


# Every op of the namespace, in a fixed order (the keys of count_collectives and the byte counts).
# Gradient convention (Megatron's): a replicated tensor's gradient is replicated, so all_reduce's backward
# is the identity and identity_fwd_all_reduce_bwd's an all-reduce.
COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", ("all_reduce",), (), "same", "all_reduce", schema='Tensor x, str group, str op="sum"',
               kernel="all_reduce", grad_hook=_all_reduce_grad, reduce_arg=2,
               doc='Reduce ``x`` over ``group`` ("sum", "avg", "max" or "min"); every rank gets the result. '
                   'Backward: identity for "sum" (the gradient is already replicated), divided by the group '
                   'size for "avg", none for "max"/"min".'),
    Collective("identity_fwd_all_reduce_bwd", (), ("all_reduce",), "same", "identity", schema="Tensor x, str group",
               kernel="identity", grad="all_reduce", grad_args=(("op", "sum"),),
               doc="Identity (a copy); backward: all-reduce sum of the gradient over ``group``."),
    Collective("all_gather", ("all_gather",), (), "gather", "all_gather_into_tensor", kernel="all_gather",
               grad="scatter_slice",
               doc="Concatenate the ranks' ``x`` along ``dim`` in group-rank order (dim grows ``group size`` "
                   "times). Backward: this rank's slice of the (replicated) gradient."),
    Collective("all_gather_rs_bwd", ("all_gather",), ("reduce_scatter",), "gather", "all_gather_into_tensor",
               kernel="all_gather", grad="reduce_scatter", fused=("all_gather_linear",),
               doc="As ``all_gather``, but the gradient reaching it is a per-rank partial sum (sequence "
                   "parallel, ZeRO-3), so its backward is a reduce-scatter."),
    Collective("reduce_scatter", ("reduce_scatter",), ("all_gather",), "scatter", "reduce_scatter_tensor",
               schema="Tensor x, str group, SymInt dim, str? comm_dtype=None", kernel="reduce_scatter",
               grad="all_gather", comm_dtype_arg=3, comm_dtypes=REDUCE_SCATTER_COMM_DTYPES,
               fused=("linear_reduce_scatter",),
               doc="Sum ``x`` over ``group`` and keep this rank's slice along ``dim`` (dim shrinks ``group "
                   "size`` times), sent in the wire format ``comm_dtype`` (:mod:`fxpar.ir.wire`). Backward: "
                   "all-gather."),
    Collective("scatter_slice", (), ("all_gather",), "scatter", "slice", kernel="slice", grad="all_gather",
               doc="This rank's slice along ``dim`` of a tensor replicated over ``group`` (no communication). "
                   "Backward: all-gather of the gradient along ``dim``."),
    # ZeRO-3: gathered for forward, gathered again for backward (fxpar.runtime.zero3), gradient
    # reduce-scattered: its backward payload counts twice
    Collective("gather_params", ("all_gather",), ("all_gather", "reduce_scatter"), "gather",
               "all_gather_into_tensor",
               schema="Tensor x, str group, SymInt dim, ScalarType? dtype=None, str? comm_dtype=None",
               kernel="all_gather", grad_hook=_gather_params_grad, cast_arg=3, comm_dtype_arg=4,
               comm_dtypes=GATHER_COMM_DTYPES, observed=True,
               doc="ZeRO-3: this rank's shard of a flat parameter bucket, gathered to the full bucket along "
                   "``dim`` (cast to ``dtype`` first when given: mixed precision communicates and computes in "
                   "bf16), sent in the wire format ``comm_dtype`` (:mod:`fxpar.ir.wire`). Backward: "
                   "reduce-scatter of the gradient in the shard's own dtype (fp32 master weights: fp32 "
                   "reductions), each rank keeping its shard's sum."),
    # Context parallelism's Ulysses attention (fxpar.passes.cp_ulysses): its own inverse, so its own gradient
    Collective("all_to_all", ("all_to_all",), ("all_to_all",), "same", "all_to_all_single",
               schema="Tensor x, str group",
               kernel="all_to_all", grad="all_to_all", check=_check_blocks, route=_block_route,
               doc="Block ``j`` of ``x``'s dim 0 (cut into group-size equal blocks) goes to rank ``j``; block "
                   "``i`` of the output came from rank ``i`` (each rank sends (n - 1) / n of ``x``). Backward: "
                   "the same all-to-all of the gradient."),
    # Expert parallelism's ops (fxpar.ir.expert_ops): counted by their own counters, never lowered
    Collective("ep_counts", ("all_gather",), (), "gather", "opaque", schema="Tensor offs, str group, str layer",
               kernel="all_gather", prepare=ep_layout.counts_row, tally=ep_layout.tally_load, counter="counts",
               counted=False,
               doc="``[ep, E]`` int64: every ep rank's tokens per expert (``offs``: this rank's cumulative "
                   "counts), one all-gather of this rank's counts; the step's counters hear of the load of "
                   "``layer``."),
    Collective("ep_dispatch", ("all_to_all",), ("all_to_all",), "gather", "opaque",
               schema="Tensor x, Tensor counts, str group, str layer, bool backward=False", kernel="all_to_all",
               grad="ep_combine", grad_args=(("backward", True),), check=ep_layout.check_tokens,
               route=ep_layout.dispatch_route, counter="dispatch", counted=False,
               doc="``x`` ``[N, H]`` sorted by expert -> ``[ep * N, H]``: the tokens of this rank's experts, "
                   "grouped by local expert, then zero rows."),
    Collective("ep_combine", ("all_to_all",), ("all_to_all",), "scatter", "opaque",
               schema="Tensor y, Tensor counts, str group, str layer, bool backward=False", kernel="all_to_all",
               grad="ep_dispatch", grad_args=(("backward", True),), check=ep_layout.check_tokens,
               route=ep_layout.combine_route, counter="combine", counted=False,
               doc="``y`` ``[ep * N, H]`` in ``ep_dispatch``'s order -> ``[N, H]`` back on the ranks and rows "
                   "the tokens came from."),
    # ... and for experts run as a loop over the experts (fxpar.passes.ep_loops): every rank's token inputs
    # gathered, the per-expert sums reduce-scattered back
    Collective("ep_gather", ("all_gather",), ("reduce_scatter",), "gather", "opaque",
               schema="Tensor x, str group, str layer, bool backward=False", kernel="all_gather",
               grad="ep_scatter", grad_args=(("backward", True),), counter="gather", counted=False,
               doc="``x`` ``[T, ...]`` of every ep rank concatenated along dim 0 (``[ep * T, ...]``, rank "
                   "order): a loop-form MoE layer's token inputs. Backward: a reduce-scatter (each rank's "
                   "rows summed over the ranks' experts)."),
    Collective("ep_scatter", ("reduce_scatter",), ("all_gather",), "scatter", "opaque",
               schema="Tensor x, str group, str layer, bool backward=False", kernel="reduce_scatter",
               grad="ep_gather", grad_args=(("backward", True),), counter="scatter", counted=False,
               doc="``x`` ``[ep * T, ...]`` (this rank's experts' sums over every rank's tokens) summed over "
                   "the ep ranks, this rank's ``T`` rows kept. Backward: an all-gather."),
)}


def collective(name: str) -> Collective:
    """The record of fxpar op ``name``."""
    return COLLECTIVES[name]


def fused_collectives() -> dict[str, str]:
    """Qualified name of a fused kernel -> the collective op it is counted as."""
    return {f"fxpar_kernels::{k}": c.name for c in COLLECTIVES.values() for k in c.fused}
