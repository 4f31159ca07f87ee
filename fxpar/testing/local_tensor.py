"""Simulate N SPMD ranks in one process with torch's ``LocalTensorMode``.

``torch.distributed._local_tensor.LocalTensorMode(n)`` makes every tensor op run
once per simulated rank on a ``LocalTensor`` (one plain tensor per rank) and
turns c10d collectives into the equivalent arithmetic over those shards. It
needs a default process group to exist, so :func:`simulated_ranks` creates a
``"fake"`` one (rank 0 of ``n``, ``FakeStore``) when none is there, and
destroys it on exit. Use it for fast, deterministic, single-process checks of
sharding logic (DTensor, collectives); use :mod:`fxpar.testing.multiproc` for
real multi-process runs.

Caveats (the module is private in torch and evolves):

* ``dist.get_rank()`` still returns 0 under simulation; use :func:`current_rank`,
  which returns a per-rank ``SymInt`` there and the real rank elsewhere, or build
  per-rank data with :func:`per_rank_tensor` / ``LocalTensorMode.rank_map``.
* Data-dependent Python control flow on a rank (``if rank == 1``) cannot work,
  there is a single Python execution for all ranks. Point-to-point send/recv
  needs torch's ``LocalRunnerMode`` and is not wrapped here.
* ``dist.get_rank()``-keyed code in libraries sees rank 0 only.
* Random numbers: ``torch.manual_seed`` is patched to seed every simulated rank
  alike, so ``torch.randn(...)`` gives the same values on each rank. An explicit
  ``torch.Generator`` is a single object that each rank draws from in turn, so
  ranks get *different* numbers; create such inputs before entering the mode.
* Plain-tensor ops run while the mode is active also execute per rank and
  return ``LocalTensor``; compare results after leaving it (``run_spmd`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = [
    "simulated_ranks",
    "run_spmd",
    "split_ranks",
    "current_rank",
    "per_rank_tensor",
    "active_mode",
]


def _lt():
    from torch.distributed import _local_tensor

    return _local_tensor


def active_mode():
    """The innermost active ``LocalTensorMode`` (or ``None``)."""
    return _lt().local_tensor_mode()


@contextlib.contextmanager
def simulated_ranks(world_size: int, *, seed: int | None = 0) -> Iterator[Any]:
    """Context manager: simulate ``world_size`` ranks; yields the ``LocalTensorMode``.

    Creates a ``"fake"`` default process group of ``world_size`` (unless a fake one of
    that size already exists), enters ``LocalTensorMode(world_size)``, and on exit
    restores everything it changed. ``seed`` (if not None) seeds torch first, so every
    simulated rank starts from the same RNG state.
    """
    lt = _lt()
    created_pg = False
    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"simulated_ranks({world_size}) needs a 'fake' default process group of that size, "
                f"but one is already initialised (backend={backend!r}, "
                f"world_size={dist.get_world_size()}); destroy it first"
            )
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
        created_pg = True
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with lt.LocalTensorMode(world_size) as mode:
            yield mode
    finally:
        try:
            from torch.distributed.tensor import _random as dtensor_random

            dtensor_random._rng_tracker = None  # it may hold per-rank simulated state
        except Exception:
            pass
        if created_pg:
            dist.destroy_process_group()


def current_rank() -> int | torch.SymInt:
    """This rank: a per-rank ``SymInt`` under simulation, ``dist.get_rank()`` otherwise."""
    mode = active_mode()
    if mode is not None:
        lt = _lt()
        return torch.SymInt(lt.LocalIntNode({r: r for r in sorted(mode.ranks)}))
    return dist.get_rank() if dist.is_initialized() else 0


def per_rank_tensor(values: Sequence[torch.Tensor] | Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A tensor whose value differs per rank: ``values[r]`` or ``values(r)`` on rank ``r``.

    Under simulation this is a ``LocalTensor``; in a real process group it is the
    current rank's value.
    """
    cb = values if callable(values) else (lambda r: values[r])
    return _lt().rank_map(cb)


def _split_leaf(x: Any, ranks: list[int]) -> list[Any]:
    lt = _lt()
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.to_local()
    if isinstance(x, lt.LocalTensor):
        shards = x._local_tensors
        return [shards.get(r) for r in ranks]
    if isinstance(x, torch.SymInt):
        node = x.node
        if isinstance(node, lt.LocalIntNode):
            return [node._local_ints[r] for r in ranks]
        value = node.maybe_as_int() if hasattr(node, "maybe_as_int") else None
        if value is not None:
            return [value] * len(ranks)
    return [x] * len(ranks)


def split_ranks(tree: Any, world_size: int | None = None) -> list[Any]:
    """Split a pytree of simulated values into one pytree per rank.

    ``LocalTensor`` leaves become each rank's plain tensor, ``DTensor`` leaves each
    rank's local shard, per-rank ``SymInt`` leaves each rank's int; everything else is
    shared by all ranks.
    """
    mode = active_mode()
    if world_size is None:
        if mode is None:
            raise ValueError("split_ranks needs world_size outside simulated_ranks()")
        ranks = sorted(mode.ranks)
    else:
        ranks = list(range(world_size))
    leaves, spec = pytree.tree_flatten(tree)
    split = [_split_leaf(leaf, ranks) for leaf in leaves]
    return [pytree.tree_unflatten([s[i] for s in split], spec) for i in range(len(ranks))]


def run_spmd(world_size: int, fn: Callable[..., Any], *args, seed: int | None = 0, **kwargs) -> list[Any]:
    """Run the SPMD function ``fn(*args, **kwargs)`` once for ``world_size`` simulated
    ranks and return its result split per rank (see :func:`split_ranks`), rank order."""
    with simulated_ranks(world_size, seed=seed):
        out = fn(*args, **kwargs)
        return split_ranks(out)
