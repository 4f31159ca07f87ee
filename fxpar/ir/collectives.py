"""The one record of every collective: what each communication pattern costs on a ring, and what each
``torch.ops.fxpar`` collective op communicates, how its fake kernel shapes its output and what the
lowering turns it into.

Reads: nothing. Writes nothing (two tables, built at import).

Who reads it: :mod:`fxpar.ir.ops` (the op names, the fake kernels' shape rule, the fused kernels counted as
a collective), :mod:`fxpar.cost.comm` (``RING``, ``KINDS``, ``COMMS``: bytes and ring shares),
:mod:`fxpar.passes.lower_collectives` (the functional collective each op lowers to, where its wire format
argument is), and the report through :mod:`fxpar.cost.comm` and :data:`fxpar.ir.ops.COLLECTIVE_OPS`. A new
collective is one :class:`Collective` entry here plus its schema and autograd formula in
:mod:`fxpar.ir.ops` and its eager kernel in :mod:`fxpar.runtime.collectives`; a new communication pattern
is one :class:`Comm` entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["COLLECTIVES", "COMMS", "Collective", "Comm", "collective", "fused_collectives"]


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


@dataclass(frozen=True)
class Collective:
    """One ``torch.ops.fxpar`` collective op.

    ``forward`` / ``backward``: the :data:`COMMS` patterns its forward and its backward run, in order (empty:
    none). ``shape``: its fake kernel's rule along ``dim``: ``"same"`` (the input's shape), ``"gather"`` (the
    dim grows group-size times) or ``"scatter"`` (it shrinks group-size times). ``lowering``: what
    :mod:`fxpar.passes.lower_collectives` turns it into: a ``torch.ops._c10d_functional`` op
    (``"all_reduce"``, ``"all_gather_into_tensor"``, ``"reduce_scatter_tensor"``), or ``"slice"`` / ``"identity"``
    (local, no communication). ``cast_arg``: the position of a dtype argument cast to before communicating;
    ``comm_dtype_arg``: of the wire format argument (:mod:`fxpar.ir.wire`; a quantized node is not lowered).
    ``fused``: the ``fxpar_kernels`` ops (:mod:`fxpar.ir.kernel_catalogue`) that run this op inside and count as it.
    """

    name: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    shape: str
    lowering: str
    cast_arg: int | None = None
    comm_dtype_arg: int | None = None
    fused: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [c for c in self.forward + self.backward if c not in COMMS]
        if unknown or self.shape not in ("same", "gather", "scatter"):
            raise ValueError(f"collective {self.name!r}: patterns {unknown} are not in COMMS, or shape "
                             f"{self.shape!r} is not one of same/gather/scatter")


# Every op of the namespace, in a fixed order (the keys of count_collectives and the byte counts).
# Gradient convention (Megatron's): a replicated tensor's gradient is replicated, so all_reduce's backward
# is the identity and identity_fwd_all_reduce_bwd's an all-reduce.
COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("all_reduce", ("all_reduce",), (), "same", "all_reduce"),
    Collective("identity_fwd_all_reduce_bwd", (), ("all_reduce",), "same", "identity"),
    Collective("all_gather", ("all_gather",), (), "gather", "all_gather_into_tensor"),
    Collective("all_gather_rs_bwd", ("all_gather",), ("reduce_scatter",), "gather", "all_gather_into_tensor",
               fused=("all_gather_linear",)),
    Collective("reduce_scatter", ("reduce_scatter",), ("all_gather",), "scatter", "reduce_scatter_tensor",
               comm_dtype_arg=3, fused=("linear_reduce_scatter",)),
    Collective("scatter_slice", (), ("all_gather",), "scatter", "slice"),
    # ZeRO-3: gathered for forward, gathered again for backward (fxpar.runtime.zero3), gradient
    # reduce-scattered: its backward payload counts twice
    Collective("gather_params", ("all_gather",), ("all_gather", "reduce_scatter"), "gather",
               "all_gather_into_tensor", cast_arg=3, comm_dtype_arg=4),
)}


def collective(name: str) -> Collective:
    """The record of fxpar op ``name``."""
    return COLLECTIVES[name]


def fused_collectives() -> dict[str, str]:
    """Qualified name of a fused kernel -> the collective op it is counted as."""
    return {f"fxpar_kernels::{k}": c.name for c in COLLECTIVES.values() for k in c.fused}
