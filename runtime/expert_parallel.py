"""The byte counts of the expert-parallel ops (:mod:`fxpar.ir.expert_ops`) and the MoE load statistics of the
last step.

Reads: what the ops' kernels count. Writes: the counters of the step running now (:class:`EpCounters`, made
the active :class:`fxpar.runtime.collectives.Counting` by ``CompiledModel.ep`` around each step). The three
ops are records of :mod:`fxpar.ir.collectives`: the runtime's ``all_gather`` and ``all_to_all`` patterns run
them (:mod:`fxpar.runtime.collectives`), as :mod:`fxpar.ir.ep_layout` lays their counts and rows out, and
count their bytes (the records' ``counter``) and loads (``ep_counts``' ``tally``) into these counters.

* ``ep_counts``: one all-gather of the ``E`` per-expert counts over the ep group (``E * ep`` int64).
* ``ep_dispatch``: split sizes from the counts, one ``all_to_all_single`` of the rows (a rank's rows for
  ep rank ``j`` are contiguous: they are sorted by expert and ``j`` owns a contiguous range), then the
  received rows reordered from source-major to local-expert-major into the static ``[ep * N, H]``
  buffer. ``ep_combine``: the inverse permutation and the all-to-all back.
* Bytes counted (:meth:`EpCounters.snapshot`'s ``"comm"``): per op, the rows this rank sends to *other* ranks x
  hidden x element size (the rows a rank keeps for its own experts never travel; the counts' all-gather
  apart, under ``"counts"``). ``dispatch``/``combine`` are the forward's, ``dispatch_bwd``/``combine_bwd``
  the backward's (combine's gradient is a dispatch and vice versa). Summed over the ep group, dispatch
  and combine each move exactly the tokens routed off their rank x hidden x element size.
* Every wait is bounded by the process group's timeout and fails as a ``CollectiveError`` naming the
  op and group (``fxpar.runtime.collectives``).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fxpar.runtime.collectives import Counting as _Counting


class EpCounters:
    """What the kernels counted while these counters were the active ones (:class:`ExpertParallelRecord`'s,
    during its step): ``comm``, op -> bytes this rank sent off-rank; ``load``, MoE layer -> ``[ep, E]`` tokens
    per (source rank, expert)."""

    def __init__(self):
        self.comm: dict[str, int] = defaultdict(int)
        self.load: dict[str, torch.Tensor] = {}

    def add_load(self, layer: str, counts: torch.Tensor) -> None:
        prev = self.load.get(layer)
        self.load[layer] = counts.detach().cpu() + (prev if prev is not None else 0)

    def snapshot(self) -> dict:
        """``{"comm": {op: bytes}, "load": {layer: stats}}``. Per layer: ``tokens_per_expert`` (over this
        rank's ep group, every microbatch), ``tokens_per_rank`` (what each ep rank's experts received),
        ``imbalance`` (max / mean of ``tokens_per_rank``; 1.0 is perfect balance)."""
        return {"comm": dict(self.comm), "load": load_stats(self.load)}


def load_stats(counts: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per MoE layer, from its ``[ep, E]`` tokens per (source ep rank, expert): ``tokens_per_expert``,
    ``tokens_per_rank`` (what each ep rank's experts receive) and ``imbalance`` (their max / mean)."""
    load = {}
    for layer, m in counts.items():
        per_expert = m.sum(0)
        per_rank = per_expert.view(m.shape[0], -1).sum(1)
        mean = per_rank.double().mean().item()
        load[layer] = {"tokens_per_expert": per_expert.tolist(), "tokens_per_rank": per_rank.tolist(),
                       "imbalance": per_rank.max().item() / mean if mean else 1.0}
    return load


def format_load(stats: dict[str, dict]) -> str:
    """The load statistics as a table: one line per MoE layer (``fxpar plan`` / ``fxpar inspect``)."""
    lines = [f"{'MoE layer':<36} {'tokens per ep rank':<22} {'max/mean':>8}  tokens per expert"]
    for layer, s in stats.items():
        lines.append(f"{layer:<36} {str(s['tokens_per_rank']):<22} {s['imbalance']:>8.2f}  {s['tokens_per_expert']}")
    worst = max((s["imbalance"] for s in stats.values()), default=1.0)
    lines.append(f"worst imbalance {worst:.2f} (1.00: every ep rank's experts get the same number of tokens)")
    return "\n".join(lines)


class ExpertParallelRecord:
    """``CompiledModel.ep``: ``info`` (the pass's :class:`~fxpar.ir.expert_ops.EpResult`, None without
    ep), ``expert_ids`` (ids of the expert slices this rank holds: reduced over dp (x cp) only, gathered over ep),
    and of the last step (a priced model: of the example batch, routed on one process): ``stats``, per MoE
    layer the load over this rank's ep group (``tokens_per_expert``, ``tokens_per_rank``, ``imbalance``),
    and ``comm``, the bytes this rank sent to other ranks per op (see the module docstring)."""

    def __init__(self, info, program):
        self.info = info
        self.expert_ids = {id(program.tensor(f)) for f in info.experts} if info is not None else set()
        self.stats: dict[str, dict] = {}
        self.comm: dict[str, int] = {}
        self.counters = EpCounters()

    def start(self) -> None:
        """Count this step's bytes and loads on fresh counters of this record's."""
        self.counters = _Counting.active = EpCounters()

    def finish(self) -> None:
        last = self.counters.snapshot()
        self.stats, self.comm = last["load"], last["comm"]
        if _Counting.active is self.counters:
            _Counting.active = None

    def set_load(self, counts: dict[str, torch.Tensor]) -> None:
        """``stats`` from ``[ep, E]`` counts per MoE layer (the API's ``price``)."""
        self.stats = load_stats(counts)

    def __repr__(self) -> str:
        return f"ExpertParallelRecord(layers={self.info.layers if self.info else []}, comm={self.comm})"

