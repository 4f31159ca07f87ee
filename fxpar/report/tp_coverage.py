"""Tensor-parallel coverage: per module, which weights a TP plan cuts and which it leaves whole and why,
and the share of the model's parameters one TP rank holds.

Reads plain data (the report layer imports only ``ir`` and ``cost``): the model's parameter table as
traced (``Program.params``, full shapes, tied weights once under their canonical FQN), the TP pass's
:class:`~fxpar.ir.placement.TpResult` (``sharded``, ``replicated`` reasons, ``gathered``, ``fallbacks``)
and, with a pipeline, each stage's canonical FQNs. Modules repeated over layers are one row, their
layer indices written ``*`` (``model.layers.*.mlp.up_proj``: the glob a ``tp_plan`` entry would use).

The share counts parameter elements, not buffers: what one TP rank holds (a cut weight's local shape,
a whole one in full) over the model's; where the degree does not divide a cut dim, the ranks' parts
differ (``torch.chunk``'s shares) and rank 0's, the largest, is counted; ``uneven`` lists those
parameters with each rank's size. ZeRO divides it further by dp; that is not counted here.
:func:`sharding_warning` is the compile path's warning text when more than 10% of the parameters stay
whole where sharding was possible (reason kinds in :data:`~fxpar.ir.placement.SHARDABLE`, >= 2-D).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from fxpar.ir.errors import ShardingWarning
from fxpar.ir.placement import (
    SHARDABLE,
    WHY_BY_DESIGN,
    WHY_NOT_DIVISIBLE,
    WHY_NOT_UNDERSTOOD,
    TpResult,
    why_kind,
)
from fxpar.ir.program import ParamInfo
from fxpar.ir.rank_view import view_of
from fxpar.report.table import columns, human

WARN_ABOVE = 0.10  # the share of the parameters left whole where sharding was possible that warns


@dataclass
class CoverageRow:
    """One module (layer indices as ``*``): its parameter elements, cut, whole (and of those, where
    sharding was possible), the elements one TP rank holds, and why the whole ones are whole."""

    module: str
    params: int = 0
    sharded: int = 0
    replicated: int = 0
    shardable: int = 0
    local: int = 0
    why: str = ""
    reasons: dict[str, int] = field(default_factory=dict)  # reason -> elements (for `why`, largest first)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "reasons"}


@dataclass
class Coverage:
    """The coverage of one TP plan: ``rows`` in model order, ``by_kind`` the whole elements per reason
    kind, ``stages`` per pipeline stage (params, local, share), ``gathered`` cut weights gathered at use."""

    tp: int
    total: int
    local: int
    shardable: int
    rows: list[CoverageRow]
    by_kind: dict[str, int]
    stages: list[dict] = field(default_factory=list)
    gathered: dict[str, str] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    uneven: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # FQN -> (dim, each rank's size)

    @property
    def share(self) -> float:
        """Parameter elements one TP rank holds over the model's."""
        return self.local / self.total if self.total else 1.0

    @property
    def shardable_share(self) -> float:
        """Elements left whole where sharding was possible, over the model's."""
        return self.shardable / self.total if self.total else 0.0

    def largest_replicated(self, shardable_only: bool = False) -> list[CoverageRow]:
        """Rows holding whole weights, most whole elements first."""
        key = (lambda r: r.shardable) if shardable_only else (lambda r: r.replicated)
        return sorted((r for r in self.rows if key(r)), key=key, reverse=True)

    def to_dict(self) -> dict:
        return {"tp": self.tp, "params": self.total, "local": self.local, "share": round(self.share, 4),
                "shardable_replicated": self.shardable, "replicated_by_kind": dict(self.by_kind),
                "modules": [r.to_dict() for r in self.rows], "stages": self.stages,
                "gathered": dict(self.gathered), "fallbacks": list(self.fallbacks),
                "uneven": {k: {"dim": d, "sizes": n} for k, (d, n) in self.uneven.items()}}

    def to_text(self) -> str:
        head = (f"tensor-parallel coverage (tp={self.tp}): one TP rank holds {100 * self.share:.1f}% of the "
                f"parameters ({human(self.local)} of {human(self.total)} elements)")
        kinds = ", ".join(f"{k} {100 * n / max(self.total, 1):.1f}%" for k, n in self.by_kind.items() if n)
        lines = [head, f"left whole: {kinds or 'nothing'}; where sharding was possible: "
                       f"{100 * self.shardable_share:.1f}%"]
        if len(self.stages) > 1:
            lines.append("per stage: " + ", ".join(f"stage {s['stage']} {100 * s['share']:.1f}% of "
                                                   f"{human(s['params'])}" for s in self.stages))
        table = [("module", "params", "sharded", "replicated")]
        table += [(r.module or "(root)", human(r.params), human(r.sharded), human(r.replicated)) for r in self.rows]
        aligned = columns(table, left=0).splitlines()  # the header, its rule, then one line per row
        whys = ["why", "-" * 3] + [r.why for r in self.rows]
        lines += [""] + [f"{a}  {w}" for a, w in zip(aligned, whys)]
        lines += [f"gathered at use: {fqn}: {why}" for fqn, why in list(self.gathered.items())[:5]]
        if self.uneven:  # modules repeated over layers: one line
            cut = {f"{module_glob(fqn.rpartition('.')[0])}.{fqn.rpartition('.')[2]}: Shard({d}), "
                   f"{' / '.join(map(str, sizes))}": None for fqn, (d, sizes) in self.uneven.items()}
            lines.append("cut unevenly (tp does not divide the dim; torch.chunk's share on each rank):")
            lines += [f"  {line}" for line in cut]
        if self.fallbacks:
            lines.append(f"ops on gathered inputs: {len(self.fallbacks)} ({'; '.join(self.fallbacks[:3])}"
                         f"{', ...' if len(self.fallbacks) > 3 else ''})")
        return "\n".join(line.rstrip() for line in lines)


def module_glob(module: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: one row for a module repeated over layers."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", module)


def _local_numel(info: ParamInfo, tp: TpResult) -> int:
    layout = tp.layout(info.fqn)
    return info.numel if layout is None else math.prod(layout.local_shape(info.shape))


def _whole_numel(info: ParamInfo, tp: TpResult) -> int:
    """Elements of a cut parameter in the fused pieces every rank holds whole (0 for none)."""
    layout = tp.layout(info.fqn)
    if layout is None or not layout.whole or not layout.pieces:
        return 0
    return sum(layout.pieces[i] for i in layout.whole) * (info.numel // info.shape[layout.dim])


def coverage(params: dict[str, ParamInfo], tp: TpResult, stages: Sequence[Sequence[str]] = ()) -> Coverage:
    """The coverage of ``tp`` over the model's parameter table ``params`` (full shapes; buffers skipped);
    ``stages``: each pipeline stage's canonical FQNs (a share per stage when there are several)."""
    rows: dict[str, CoverageRow] = {}
    by_kind: dict[str, int] = {}
    total = local = shardable = 0
    for fqn, info in params.items():
        if info.is_buffer:
            continue
        row = rows.setdefault(module_glob(info.module), CoverageRow(module_glob(info.module)))
        n, mine = info.numel, _local_numel(info, tp)
        row.params, row.local = row.params + n, row.local + mine
        total, local = total + n, local + mine
        whole = _whole_numel(info, tp)  # fused pieces every rank holds
        if tp.layout(fqn) is not None and whole <= 0:
            row.sharded += n
            if fqn in tp.gathered:
                row.reasons[tp.gathered[fqn]] = row.reasons.get(tp.gathered[fqn], 0) + n
            continue
        if tp.layout(fqn) is not None:  # cut, but with pieces every rank holds whole (one K/V head)
            row.sharded, n = row.sharded + n - whole, whole
            pieces = [tp.pieces[fqn][i] for i in getattr(tp, "whole", {}).get(fqn, ())]
            reason = f"{WHY_NOT_DIVISIBLE}: fused pieces {pieces} of {tuple(info.shape)} held whole on every rank"
        else:
            reason = tp.replicated.get(fqn, "no plan entry: not reported by the pass")
        kind = why_kind(reason)
        row.replicated += n
        row.reasons[reason] = row.reasons.get(reason, 0) + n
        by_kind[kind] = by_kind.get(kind, 0) + n
        if kind in SHARDABLE and len(info.shape) >= 2:
            row.shardable += n
            shardable += n
    for row in rows.values():
        ranked = sorted(row.reasons.items(), key=lambda kv: -kv[1])
        row.why = ranked[0][0] if ranked else ""
        others = {why_kind(r) for r, _ in ranked[1:]} - {why_kind(row.why), WHY_BY_DESIGN}  # biases go unsaid
        if others:
            row.why += f" (also {', '.join(sorted(others))})"
    per_stage = []
    for i, names in enumerate(stages):
        infos = [params[f] for f in names if f in params and not params[f].is_buffer]
        n, mine = sum(p.numel for p in infos), sum(_local_numel(p, tp) for p in infos)
        per_stage.append({"stage": i, "params": n, "local": mine, "share": round(mine / n, 4) if n else 1.0})
    uneven = {fqn: (tp.sharded[fqn], sizes) for fqn, sizes in tp.uneven().items()}
    return Coverage(tp.parts, total, local, shardable, list(rows.values()),
                    dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), per_stage, dict(tp.gathered),
                    list(tp.fallbacks), uneven)


def coverage_of(compiled) -> Coverage | None:
    """The coverage of a compiled model's TP plan (``compiled``: a :class:`~fxpar.ir.rank_view.RankView`
    or a model giving one); None without TP."""
    v = view_of(compiled)
    tp = v.result.tp
    if not isinstance(tp, TpResult) or tp.parts <= 1:
        return None
    stages = [list(s.params) for s in v.pipeline.stages]
    return coverage(v.result.traced.params, tp, stages)


def sharding_warning(cov: Coverage, above: float = WARN_ABOVE) -> str | None:
    """The warning when more than ``above`` of the parameters stay whole where sharding was possible,
    naming the largest such modules and the fix; None otherwise."""
    if cov.shardable <= above * cov.total:
        return None
    top = cov.largest_replicated(shardable_only=True)[:4]
    named = "; ".join(f"{r.module} ({human(r.shardable)} elements, {r.why})" for r in top)
    example = top[0].module
    return (f"fxpar.report.tp_coverage: Plan(tp={cov.tp}) leaves {100 * cov.shardable_share:.0f}% of the "
            f"parameters whole on every rank where they could be cut (more than {100 * above:.0f}%; each TP rank "
            f"holds {100 * cov.share:.0f}% of the parameters). Largest: {named}. Fix: give those modules "
            f"tp_plan entries next to the plan's others, e.g. Plan(tp={cov.tp}, tp_plan={{..., '{example}': STYLE}}) "
            f"with STYLE 'colwise' for a layer whose output feeds another layer, 'rowwise' for that one, "
            f"'vocab_parallel' for an embedding (fxpar.passes.tensor_parallel.STYLES); "
            f"`fxpar plan MODEL --plan tp={cov.tp}` prints the per-module table"
            + ("; a layout not understood needs a rule (fxpar/passes/tensor_parallel/rules, docs/tensor_parallel.md)"
               if any(why_kind(r.why) == WHY_NOT_UNDERSTOOD for r in top) else ""))


def warn_if_replicated(params: dict[str, ParamInfo], tp: TpResult | None, stacklevel: int = 2) -> Coverage | None:
    """Warn (:class:`~fxpar.ir.errors.ShardingWarning`) when ``tp`` leaves too much whole; the coverage."""
    if not isinstance(tp, TpResult) or tp.parts <= 1:
        return None
    cov = coverage(params, tp)
    text = sharding_warning(cov)
    if text is not None:
        warnings.warn(text, ShardingWarning, stacklevel=stacklevel + 1)
    return cov
