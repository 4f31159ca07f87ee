"""How expert parallelism's ops move rows and counts: the hooks of the ``ep_counts``, ``ep_dispatch`` and
``ep_combine`` records (:mod:`fxpar.ir.collectives`).

Reads: the router's cumulative counts, a ``[ep, E]`` counts tensor (row ``s``: ep rank ``s``'s tokens per
expert) and the rows to move. Writes nothing but the load it tells the step's counters of: the counts
row ``ep_counts`` gathers, split sizes and permutations, which the runtime's ``all_gather`` and
``all_to_all`` patterns (:mod:`fxpar.runtime.collectives`) run. Pure torch, no process group, so it lives
in the vocabulary layer with the records that name it; the layout itself is :mod:`fxpar.ir.expert_ops`' docstring's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxpar.ir.errors import CollectiveError

__all__ = ["check_tokens", "combine_route", "counts_row", "dispatch_route", "layout", "tally_load"]

Route = tuple[torch.Tensor, list[int], list[int], Callable[[torch.Tensor], torch.Tensor]]


def counts_row(offs: torch.Tensor) -> torch.Tensor:
    """``[1, E]`` int64: this rank's tokens per expert, from the router's cumulative ``offs`` ``[E]``."""
    return torch.diff(offs.long(), prepend=offs.new_zeros(1).long()).view(1, -1)


def tally_load(counters, out: torch.Tensor, args: dict) -> None:
    """Tell the step's counters (``add_load``) of the ``[ep, E]`` counts gathered for MoE layer ``layer``."""
    counters.add_load(args["layer"], out)


def check_tokens(op: str, group: str, x: torch.Tensor, args: dict, n: int) -> None:
    """``x`` must be ``[rows, hidden]`` tokens and ``args["counts"]`` ``[ep=n, experts]``."""
    counts = args["counts"]
    if x.dim() != 2 or counts.dim() != 2 or counts.shape[0] != n:
        raise CollectiveError(f"takes [rows, hidden] tokens and [ep={n}, experts] counts, got {tuple(x.shape)} "
                              f"and {tuple(counts.shape)}", op=op, group=group)


def layout(counts: torch.Tensor, me: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(rows this rank sends to each ep rank, rows it receives from each, the permutation from the received
    source-major order to local-expert-major)."""
    n, e = counts.shape
    k = e // n
    counts = counts.cpu()
    send = counts[me].view(n, k).sum(1).tolist()
    mine = counts[:, me * k:(me + 1) * k]  # [source, local expert]
    recv = mine.sum(1).tolist()
    start = (torch.cumsum(mine.reshape(-1), 0) - mine.reshape(-1)).view(n, k)  # each piece's source-major start
    cnt, src = mine.t().reshape(-1), start.t().reshape(-1)  # the pieces in local-expert-major order
    dst = torch.cumsum(cnt, 0) - cnt  # where each piece starts in that order
    perm = torch.arange(int(cnt.sum())) + torch.repeat_interleave(src - dst, cnt)
    return send, recv, perm


def dispatch_route(x: torch.Tensor, args: dict, n: int, me: int) -> Route:
    """(rows to send, their split sizes, the received split sizes, what makes the output of the received
    rows): ``x`` as it is (a rank's rows for ep rank ``j`` are contiguous), then the received rows reordered
    from source-major to local-expert-major into the static ``[ep * N, H]`` buffer, zeros after them."""
    send, recv, perm = layout(args["counts"], me)

    def finish(got: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((n * x.shape[0], x.shape[1]))
        out[:perm.numel()] = got[perm.to(x.device)]
        return out

    return x, send, recv, finish


def combine_route(y: torch.Tensor, args: dict, n: int, me: int) -> Route:
    """The inverse of :func:`dispatch_route`: the local experts' rows back in source-major order, sent
    with the dispatch's split sizes swapped; the received rows are the output, in ``x``'s order."""
    send, recv, perm = layout(args["counts"], me)
    rows = y.new_empty((perm.numel(), y.shape[1]))
    rows[perm.to(y.device)] = y[:perm.numel()]  # back to source-major order
    return rows, recv, send, lambda got: got
