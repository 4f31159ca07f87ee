"""Placements and shard layouts: how a tensor is laid out over the ranks of one mesh axis.

Placements are torch's own (``Shard(d)``, ``Replicate()``, ``Partial()``, as DTensor uses them), re-exported
here so the IR has one vocabulary. A :class:`ShardLayout` says how a full tensor is cut into ``parts``
(the TP degree) along ``dim``; a fused tensor (``pieces``: the sizes of its parts along ``dim``, e.g.
``[q, k, v]``) is cut part by part, so each rank holds its slice of every part, concatenated. It is pure
arithmetic on tensors and shapes: no process groups. :class:`TpResult` is what the tensor-parallel pass
reports about the parameters it cut.

    >>> layout = ShardLayout(dim=0, pieces=[4, 2], parts=2)
    >>> layout.local_shape((6, 3))
    (3, 3)
    >>> layout.slice(torch.arange(6), 1).tolist()  # rank 1: the second half of each piece
    [2, 3, 5]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Partial", "Placement", "Replicate", "Shard", "ShardLayout", "TpResult", "as_placement"]


def as_placement(dim: int | None) -> Placement:
    """``Shard(dim)``, or ``Replicate()`` for None."""
    return Replicate() if dim is None else Shard(dim)


@dataclass(frozen=True)
class ShardLayout:
    """A tensor cut into ``parts`` along ``dim``; with ``pieces``, each piece (along ``dim``) cut apart."""

    dim: int
    pieces: list[int] | None = None
    parts: int = 1

    def local_shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one rank's part of a tensor of ``full_shape``."""
        shape = list(full_shape)
        shape[self.dim] //= self.parts
        return tuple(shape)

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of the full tensor whose parts have ``local_shape``."""
        shape = list(local_shape)
        shape[self.dim] *= self.parts
        return tuple(shape)

    def ranges(self, size: int, rank: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges along ``dim`` (full size ``size``) that ``rank`` holds, one per piece."""
        out, start = [], 0
        for p in self.pieces or [size]:
            step = p // self.parts
            out.append((start + rank * step, start + (rank + 1) * step))
            start += p
        return out

    def slice(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s part of ``full`` (a copy)."""
        parts = full.split(self.pieces, dim=self.dim) if self.pieces else [full]
        return torch.cat([part.chunk(self.parts, dim=self.dim)[rank] for part in parts], dim=self.dim).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order (the inverse of :meth:`slice`)."""
        if len(shards) != self.parts:
            raise ValueError(f"ShardLayout.unshard: {len(shards)} parts given for a layout of {self.parts}")
        if not self.pieces:
            return torch.cat(list(shards), dim=self.dim)
        split = [s.split([p // self.parts for p in self.pieces], dim=self.dim) for s in shards]
        return torch.cat([torch.cat([split[r][i] for r in range(self.parts)], dim=self.dim)
                          for i in range(len(self.pieces))], dim=self.dim)


@dataclass
class TpResult:
    """What the tensor-parallel pass did to the parameters: empty when it did not run.

    ``sharded``: canonical FQN -> the dim it is cut along. ``pieces``: FQN -> the sizes of a fused
    tensor's parts along that dim ([q, k, v]). ``fallbacks``: ops that ran on gathered inputs ("name
    (target) in module"). ``parts``: the TP degree.
    """

    sharded: dict[str, int] = field(default_factory=dict)
    pieces: dict[str, list[int]] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    parts: int = 1

    def layout(self, fqn: str) -> ShardLayout | None:
        """How ``fqn`` is cut over the TP ranks, or None when every rank holds it whole."""
        d = self.sharded.get(fqn)
        return None if d is None else ShardLayout(d, self.pieces.get(fqn), self.parts)
