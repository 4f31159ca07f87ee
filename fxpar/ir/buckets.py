"""``FlatBucket``: several tensors laid end to end in one flat buffer, padded to split into equal shards.

Reads: names and shapes of the tensors of one bucket, and the data-parallel degree. Writes nothing;
it holds no process group and no tensor of its own.

Why one layout: DDP and ZeRO-1/2 (``fxpar.runtime.data_parallel``, gradient buckets) and ZeRO-3
(``fxpar.passes.zero3``, parameter buckets) flatten tensors the same way: tensor ``i`` at
``offsets[i]``, ``numels[i]`` entries, the whole padded with zeros to ``shard_numel * dp`` so that
data-parallel rank ``r`` owns ``[r * shard_numel, (r + 1) * shard_numel)``. Both read and write their
buffers through this one definition, so a bucket flattened by one side unflattens on the other::

    >>> b = FlatBucket(["w", "b"], [(2, 3), (3,)], dp=4)
    >>> b.offsets, b.numel, b.shard_numel, b.padding, b.shard_range(1)
    ([0, 6], 9, 3, 3, (3, 6))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class FlatBucket:
    """The flat layout of tensors ``names`` (shapes ``shapes``) sharded over ``dp`` ranks."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dp: int):
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.names))]
        self.numel = sum(self.numels)
        self.dp = dp
        self.shard_numel = math.ceil(self.numel / dp)

    @property
    def padded_numel(self) -> int:
        """Entries of the full flat buffer: ``shard_numel * dp`` (the tensors, then zeros)."""
        return self.shard_numel * self.dp

    @property
    def padding(self) -> int:
        """Zeros after the last tensor, so that the buffer splits into ``dp`` equal shards."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)``: the entries of the flat buffer data-parallel rank ``rank`` owns."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten(self, tensors: Sequence[torch.Tensor | None], *, dtype: torch.dtype,
                device: torch.device | str) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (one per name, in order); None leaves zeros."""
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is not None:
                flat[off:off + n] = t.detach().reshape(-1)
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor of the bucket as a view of the full flat buffer ``flat``, in order."""
        return [flat[o:o + k].view(s) for o, k, s in zip(self.offsets, self.numels, self.shapes)]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor of the bucket as a view of the full flat buffer ``flat``, by name."""
        return dict(zip(self.names, self.views(flat)))
