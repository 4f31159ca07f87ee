"""Batches of a :class:`TokenDataset` in a deterministic, resumable order, and evaluation batches.

Training order: epoch after epoch, a permutation of the samples drawn from a ``torch.Generator`` seeded
by ``(seed, epoch)`` (identity without ``shuffle``), taken ``batch`` samples at a time; the samples
after the last full batch of an epoch are skipped that epoch (``drop_last``). The order is a function
of ``(seed, epoch, len(ds))`` only, the same on every rank and every run, so the position in it (epoch,
index) is all a checkpoint needs: :meth:`Batches.state_dict` / :meth:`Batches.load_state_dict`.
Every rank takes the same global batch; a data-parallel step takes its replica's slice of it.

Evaluation (:func:`eval_batches`): every sample once, in order; the last batch is filled up with rows
that count for nothing (labels -100), so every batch has the same shape and no sample counts twice.
"""

from __future__ import annotations

import hashlib

import torch

from fxpar.ir.errors import PlanError


def epoch_seed(seed: int, epoch: int) -> int:
    """The generator seed of ``epoch``: a hash of ``(seed, epoch)``, so no two pairs share an order."""
    return int.from_bytes(hashlib.sha256(f"fxpar-data:{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


class Batches:
    """An endless iterator of dicts of ``(batch, seq)`` tensors over ``ds`` (see the module docstring)."""

    def __init__(self, ds, batch: int, seed: int = 0, shuffle: bool = True):
        if batch < 1 or len(ds) < batch:
            raise PlanError(f"data {ds.spec.path}: {len(ds)} samples of seq={ds.seq} make no batch of {batch}",
                            values={"samples": len(ds), "batch": batch},
                            fix="give more data, a shorter --seq or a smaller --batch")
        self.ds, self.batch, self.seed, self.shuffle = ds, batch, seed, shuffle
        self.epoch = 0
        self.index = 0  # samples of this epoch's order already taken
        self._order = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.ds) // self.batch

    def order(self, epoch: int) -> torch.Tensor:
        """The sample order of ``epoch``."""
        n = len(self.ds)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch)))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.index + self.batch > len(self.ds):
            self.epoch, self.index, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        idx = self._order[self.index:self.index + self.batch]
        self.index += self.batch
        return self.ds.take(idx)

    def state_dict(self) -> dict:
        """The position in the order, JSON-able: ``epoch``, ``index`` (samples taken this epoch), ``seed``,
        ``shuffle``, ``samples`` (``len(ds)``), ``batch``."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "samples": len(self.ds), "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken (its seed and shuffle too). A state from a dataset of
        another length is a :class:`PlanError`: its order would be another one."""
        if int(state["samples"]) != len(self.ds):
            raise PlanError(f"data {self.ds.spec.path}: the saved data position is for a dataset of "
                            f"{state['samples']} samples, this one has {len(self.ds)}",
                            values={"saved": state["samples"], "now": len(self.ds)},
                            fix="resume with the same data file, --seq and packing, or start the data afresh")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.seed, self.shuffle = int(state["seed"]), bool(state.get("shuffle", self.shuffle))
        self._order = None


def eval_batches(ds, batch: int):
    """Every sample of ``ds`` exactly once, in order, ``batch`` at a time; the last batch is filled up with
    :meth:`TokenDataset.filler` rows (labels -100), so its shape is ``(batch, seq)`` too. A streamed dataset
    gives its own (:meth:`fxpar.data.StreamedDataset.eval_batches`, a generator of the same shape)."""
    if hasattr(ds, "eval_batches"):
        return ds.eval_batches(batch)
    if batch < 1:
        raise PlanError(f"eval batch {batch} must be at least 1")
    out = []
    for start in range(0, len(ds), batch):
        part = ds.take(range(start, min(start + batch, len(ds))))
        short = batch - part["input_ids"].shape[0]
        if short:
            fill = ds.filler(short)
            part = {k: torch.cat([v, fill[k]]) for k, v in part.items()}
        out.append(part)
    return out
