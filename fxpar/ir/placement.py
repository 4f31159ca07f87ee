"""Placements and shard layouts: how a tensor is laid out over the ranks of one mesh axis.

Placements are torch's own (``Shard(d)``, ``Replicate()``, ``Partial()``, as DTensor uses them), re-exported
here so the IR has one vocabulary. A :class:`ShardLayout` says how a full tensor is cut into ``parts``
(the TP degree) along ``dim``; a fused tensor (``pieces``: the sizes of its parts along ``dim``, e.g.
``[q, k, v]``) is cut part by part, so each rank holds its slice of every part, concatenated. A size the
degree does not divide is cut as ``torch.chunk`` and DTensor cut it (:func:`chunk_sizes`): ``ceil(n /
parts)`` per rank, the last rank smaller, so a rank's part depends on its rank. It is pure arithmetic on
tensors and shapes: no process groups. :class:`TpResult` is what the tensor-parallel pass reports about
the parameters it cut.

    >>> layout = ShardLayout(dim=0, pieces=[4, 2], parts=2)
    >>> layout.local_shape((6, 3))
    (3, 3)
    >>> layout.slice(torch.arange(6), 1).tolist()  # rank 1: the second half of each piece
    [2, 3, 5]
    >>> vocab = ShardLayout(dim=0, parts=2, size=5)  # 5 rows over 2 ranks: 3 and 2
    >>> [vocab.local_shape((5, 4), r) for r in range(2)], vocab.ranges(5, 1)
    ([(3, 4), (2, 4)], [(3, 5)])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["SHARDABLE", "WHY_KINDS", "WHY_UNUSED", "Partial", "Placement", "Replicate", "Shard", "ShardLayout",
           "TpResult", "as_placement", "chunk_fits", "chunk_sizes", "chunk_start", "why_kind"]

# Why the TP pass left a parameter whole: each TpResult.replicated reason starts with one of these kinds.
WHY_NO_PLAN = "no plan entry"  # no style reached it
WHY_NOT_UNDERSTOOD = "layout not understood"  # a style reached it, no rule could cut it
WHY_NOT_DIVISIBLE = "not divisible"  # heads that do not divide by tp, or a dim too small to give every rank a part
WHY_BY_DESIGN = "norm/bias/scalar"  # 0-D or 1-D: norm weights, a row-parallel bias (cheap)
WHY_SMALL = "small"  # a small weight with no style (a router gate)
WHY_BY_PLAN = "replicated by plan"  # the style asks for it whole
WHY_UNUSED = "unused"  # the traced program never reads it (cross-attention traced without encoder states)
WHY_KINDS = (WHY_NO_PLAN, WHY_NOT_UNDERSTOOD, WHY_NOT_DIVISIBLE, WHY_BY_DESIGN, WHY_SMALL, WHY_BY_PLAN, WHY_UNUSED)
SHARDABLE = frozenset({WHY_NO_PLAN, WHY_NOT_UNDERSTOOD})  # kinds where sharding was possible: warned about


def why_kind(reason: str) -> str:
    """The kind of a reason ``"<kind>: <details>"`` (the text before the first colon)."""
    return reason.split(":", 1)[0].strip()


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Each rank's share of ``n`` entries cut into ``parts`` as ``torch.chunk`` (and DTensor's ``Shard``) cut
    them: ``ceil(n / parts)`` each, the last ranks smaller (zero where nothing is left).

        >>> chunk_sizes(130, 4), chunk_sizes(32001, 2), chunk_sizes(5, 4)
        ([33, 33, 33, 31], [16001, 16000], [2, 2, 1, 0])
    """
    step = -(-n // parts)
    return [max(0, min(step, n - r * step)) for r in range(parts)]


def chunk_start(n: int, parts: int, rank: int) -> int:
    """Where ``rank``'s share (:func:`chunk_sizes`) of ``n`` entries starts."""
    return min(n, rank * -(-n // parts))


def chunk_fits(n: int, parts: int) -> bool:
    """Whether every one of ``parts`` ranks gets at least one of ``n`` entries (:func:`chunk_sizes`)."""
    return chunk_sizes(n, parts)[-1] > 0


def as_placement(dim: int | None) -> Placement:
    """``Shard(dim)``, or ``Replicate()`` for None."""
    return Replicate() if dim is None else Shard(dim)


@dataclass(frozen=True)
class ShardLayout:
    """A tensor cut into ``parts`` along ``dim``; with ``pieces``, each piece (along ``dim``) cut apart.
    ``whole``: indices into ``pieces`` of the pieces every rank holds whole (a multi-query attention's
    one K/V head in a fused QKV weight): a whole piece keeps its full size on every rank. ``size``: the
    full size along ``dim`` (the sum of ``pieces`` where given); needed to read a full shape back from a
    rank's part when ``parts`` does not divide it. Every cut piece is cut as :func:`chunk_sizes` says,
    so a rank's part depends on its rank where the degree does not divide a piece.

    >>> mqa = ShardLayout(dim=0, pieces=[4, 1, 1], parts=2, whole=(1, 2))  # [q | k | v], k and v whole
    >>> mqa.local_shape((6, 3))
    (4, 3)
    >>> mqa.slice(torch.arange(6), 1).tolist()  # rank 1: the second half of q, then k and v
    [2, 3, 4, 5]
    >>> mqa.unshard([mqa.slice(torch.arange(6), r) for r in range(2)]).tolist()
    [0, 1, 2, 3, 4, 5]
    >>> gate_up = ShardLayout(dim=0, pieces=[3, 3], parts=2)  # [gate | up], 3 rows each: 2 + 2, then 1 + 1
    >>> [gate_up.slice(torch.arange(6), r).tolist() for r in range(2)]
    [[0, 1, 3, 4], [2, 5]]
    """

    dim: int
    pieces: list[int] | None = None
    parts: int = 1
    whole: tuple[int, ...] = ()
    size: int | None = None

    def _pieces(self, size: int | None = None) -> list[int]:
        if self.pieces:
            return list(self.pieces)
        size = self.size if size is None else size
        if size is None:
            raise ValueError("ShardLayout: the full size along dim is unknown (give size= or pieces=)")
        return [size]

    def even(self) -> bool:
        """Whether every rank holds a part of the same size (the degree divides every cut piece)."""
        if not self.pieces and self.size is None:
            return True
        return all(p % self.parts == 0 for i, p in enumerate(self._pieces()) if i not in self.whole)

    def local_pieces(self, rank: int = 0) -> list[int] | None:
        """The size of each piece on ``rank`` (whole pieces at full size), or None without pieces."""
        if not self.pieces:
            return None
        return [p if i in self.whole else chunk_sizes(p, self.parts)[rank] for i, p in enumerate(self.pieces)]

    def local_sizes(self, size: int | None = None) -> list[int]:
        """Every rank's size along ``dim`` (``size``: the full one, where the layout does not know it)."""
        return [sum(p if i in self.whole else chunk_sizes(p, self.parts)[r] for i, p in enumerate(self._pieces(size)))
                for r in range(self.parts)]

    def local_shape(self, full_shape: Sequence[int], rank: int = 0) -> tuple[int, ...]:
        """The shape of ``rank``'s part of a tensor of ``full_shape``."""
        shape = list(full_shape)
        shape[self.dim] = self.local_sizes(shape[self.dim])[rank]
        return tuple(shape)

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the full tensor whose parts have ``local_shape`` (without ``size`` or ``pieces``:
        an even cut)."""
        shape = list(local_shape)
        shape[self.dim] = sum(self.pieces) if self.pieces else self.size if self.size is not None \
            else shape[self.dim] * self.parts
        return tuple(shape)

    def ranges(self, size: int, rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges along ``dim`` (full size ``size``) that ``rank`` holds, one per piece."""
        out, start = [], 0
        for i, p in enumerate(self.pieces or [size]):
            if i in self.whole:
                out.append((start, start + p))
            else:
                first = start + chunk_start(p, self.parts, rank)
                out.append((first, first + chunk_sizes(p, self.parts)[rank]))
            start += p
        return out

    def slice(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of ``full`` (a copy)."""
        parts = [full.narrow(self.dim, a, b - a) for a, b in self.ranges(full.shape[self.dim], rank)]
        return torch.cat(parts, dim=self.dim).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (the inverse of :meth:`slice`; a whole
        piece is taken from rank 0)."""
        if len(shards) != self.parts:
            raise ValueError(f"ShardLayout.unshard: {len(shards)} parts given for a layout of {self.parts}")
        if not self.pieces:
            return torch.cat(list(shards), dim=self.dim)
        split = [s.split(self.local_pieces(r), dim=self.dim) for r, s in enumerate(shards)]
        return torch.cat([split[0][i] if i in self.whole else torch.cat([split[r][i] for r in range(self.parts)],
                                                                        dim=self.dim)
                          for i in range(len(self.pieces))], dim=self.dim)


@dataclass
class TpResult:
    """What the tensor-parallel pass did to the parameters: empty when it did not run.

    ``sharded``: canonical FQN -> the dim it is cut along. ``pieces``: FQN -> the sizes of a fused
    tensor's parts along that dim ([q, k, v]). ``fallbacks``: ops that ran on gathered inputs ("name
    (target) in module"). ``parts``: the TP degree. ``replicated``: every parameter left whole -> why
    (``"<kind>: <details>"``, the kinds in :data:`WHY_KINDS`). ``gathered``: cut parameters whose whole
    value a rule all-gathers where they are used -> that op (memory saved, compute not). ``whole``: FQN ->
    the indices of the fused pieces every rank holds whole (:attr:`ShardLayout.whole`). ``sizes``: FQN -> its
    full size along the cut dim (a degree that does not divide it cuts it unevenly, :func:`chunk_sizes`).
    """

    sharded: dict[str, int] = field(default_factory=dict)
    pieces: dict[str, list[int]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    parts: int = 1
    replicated: dict[str, str] = field(default_factory=dict)
    gathered: dict[str, str] = field(default_factory=dict)
    whole: dict[str, tuple[int, ...]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def layout(self, fqn: str) -> ShardLayout | None:
        """How ``fqn`` is cut over the TP ranks, or None when every rank holds it whole."""
        d = self.sharded.get(fqn)
        return None if d is None else ShardLayout(d, self.pieces.get(fqn), self.parts, self.whole.get(fqn, ()),
                                                  self.sizes.get(fqn))

    def uneven(self) -> dict[str, list[int]]:
        """Parameters whose ranks hold parts of different sizes -> each rank's size along the cut dim."""
        out = {}
        for fqn in self.sharded:
            layout = self.layout(fqn)
            if layout.size is not None and not layout.even():
                out[fqn] = layout.local_sizes()
        return out
