"""The one cut algorithm: contiguous pipeline stages over a sequence of units, minimising the slowest stage.

``fxpar.compile`` (:func:`fxpar.cost.partition.balanced_cuts`: its units are the traced program's nodes
between cut candidates, weighed on the node roofline) and the planner (:class:`fxpar.cost.estimate.Pricer`:
its units are the same segments of the parts it traced, weighed the same way) both call
:func:`balanced_split`, so that for one plan and device profile the planner prices the stages compile builds.

A stage over the points ``[i, j)`` costs its forward and backward seconds (prefix sums at the points) plus
the boundary seconds at each end it shares with a neighbour (activations in and out, their gradients back).
The dynamic program is exact; among stage lists of equal cost (to :data:`TIE`) it keeps, stage by stage
from the last, the latest cut. Vectorised over the start points (numpy), so a 500-point model splits into 100
stages in tens of milliseconds. Reads numbers only; writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fxpar.cost.roofline import roofline, transfer_time

__all__ = ["TIE", "Segments", "balanced_split"]

TIE = 1e-9  # stage lists whose slowest stages differ by less than this share cost the same


def balanced_split(pf: Sequence[float], pb: Sequence[float], edge: Sequence[float], n_stages: int) -> list[int]:
    """The inner points (indices 1..k-1 into the ``k + 1`` points) where stages 2..``n_stages`` begin.

    ``pf`` / ``pb``: forward / backward seconds before each point (prefix sums: ``pf[0] = 0``, ``pf[k]``
    the whole model); ``edge[j]``: seconds a stage boundary at point ``j`` adds to each of the two stages
    it bounds (``edge[0]`` and ``edge[k]`` are not read). Stage ``[i, j)`` costs
    ``pf[j] - pf[i] + pb[j] - pb[i] + edge_i + edge_j``; the slowest stage is minimised.
    The caller checks that ``n_stages <= k``."""
    k = len(pf) - 1
    if n_stages <= 1:
        return []
    f, b = np.asarray(pf, dtype=float), np.asarray(pb, dtype=float)
    e = np.asarray(edge, dtype=float).copy()
    e[0] = e[k] = 0.0
    # cost[i, j] of stage [i, j), evaluated in the order the scalar sum ``f[j] - f[i] + b[j] - b[i] + x`` is
    cost = ((f[None, :] - f[:, None]) + b[None, :]) - b[:, None] + (e[:, None] + e[None, :])
    inf = float("inf")
    best = np.full(k + 1, inf)
    best[0] = 0.0
    arg = np.zeros((n_stages + 1, k + 1), dtype=np.int64)
    for s in range(1, n_stages + 1):
        lo, hi = s, k - (n_stages - s)  # the points stage s may end at
        nxt = np.full(k + 1, inf)
        starts = np.arange(s - 1, hi)  # the points it may start at
        # v[i, j]: the slowest stage when stage s is [i, j) after the best s - 1 stages over [0, i)
        v = np.maximum(best[starts][:, None], cost[np.ix_(starts, np.arange(lo, hi + 1))])
        v[starts[:, None] >= np.arange(lo, hi + 1)[None, :]] = inf
        # ties (within TIE: equal stages of identical layers differ in the last bits of their sums): the
        # latest start, so that two sums of the same weights in another order choose the same stages
        low = v.min(axis=0)
        near = v <= low + TIE * np.abs(low)
        pick = v.shape[0] - 1 - np.argmax(near[::-1], axis=0)
        nxt[lo:hi + 1] = v[pick, np.arange(v.shape[1])]
        arg[s, lo:hi + 1] = starts[pick]
        best = nxt
    cuts, j = [], k
    for s in range(n_stages, 1, -1):
        j = int(arg[s, j])
        cuts.append(j)
    return cuts[::-1]


class Segments:
    """The planner's side of :func:`balanced_split`: a model's segments in order, as compile's cut candidates
    make them (a part's start, each layer's children, the head), read off one trace
    (:attr:`fxpar.planner.model_costs.RankPart.units` of the tp=1 parts; ``names``: "pre", each layer's kind,
    "post"), and the stages over them for a microbatch size and dtype, cached.

    ``rows``: per segment (part index, first row, end row, bytes crossing its start and their gradients' per
    sequence, the module a stage may begin at or None, None); costs without segments (made by hand): pre and
    post whole, a layer two halves, a stage may begin at each: (part index, 0, None, 0, 0, the part's name,
    its share). ``units``: (part index, the segment's share of the part: of its roofline time for one
    sequence); ``points``: the segments a stage may begin at."""

    def __init__(self, costs, profile, names: list[str]):
        self.costs, self.profile, self.names = costs, profile, names
        self.rows = []
        for i, name in enumerate(names):
            part = costs.part(name, 1, False)
            if part.units:
                ends = [u[0] for u in part.units[1:]] + [len(part.nodes)]
                self.rows.extend((i, first, end, cross, grad, module, None)
                                 for (first, cross, grad, module), end in zip(part.units, ends))
            else:
                self.rows.extend([(i, 0, None, 0, 0, name, 1.0)] if name in ("pre", "post") else
                                 [(i, 0, None, 0, 0, name, 0.5)] * 2)
        self._times: dict = {}
        self._cuts: dict = {}
        self.units = [(seg[0], share) for seg, share in zip(self.rows, self._shares())]
        self.points = [u for u, seg in enumerate(self.rows) if u and seg[5] is not None]

    def cuts(self, n_stages: int, b: int, dtype: str) -> list[tuple[int, int]]:
        """Contiguous [start, end) ranges of the segments per stage: compile's cuts (:func:`balanced_split`
        over the same segments of the unsharded model, each on the node roofline for a microbatch of ``b``
        sequences in ``dtype``, its boundary transfers included)."""
        key = (n_stages, b, dtype)
        got = self._cuts.get(key)
        if got is not None:
            return got
        times = [self.time(u, b, dtype) for u in range(len(self.rows))]
        pts = [0, *self.points, len(self.rows)]
        pf, pb = [0.0], [0.0]
        for s, e in zip(pts, pts[1:]):
            pf.append(pf[-1] + sum(t[0] for t in times[s:e]))
            pb.append(pb[-1] + sum(t[1] for t in times[s:e]))
        edge = [0.0, *(transfer_time(self.profile, self.rows[u][3] * b) +
                       transfer_time(self.profile, self.rows[u][4] * b) for u in self.points), 0.0]
        bounds = [0, *(pts[j] for j in balanced_split(pf, pb, edge, n_stages)), len(self.rows)]
        got = self._cuts[key] = list(zip(bounds, bounds[1:]))
        return got

    def modules(self, n_stages: int, b: int, dtype: str) -> list[str | None]:
        """The modules at whose beginning :meth:`cuts` starts stages 2.. (compile's ``(module, "beginning")``
        cuts); None where the costs do not name them (made by hand)."""
        out = []
        for s, _ in self.cuts(n_stages, b, dtype)[1:]:
            i, _, end, _, _, module, _ = self.rows[s]
            out.append(None if end is None or module is None else
                       module.format(i - 1) if 0 < i < len(self.names) - 1 else module)
        return out

    def time(self, u: int, b: int, dtype: str) -> tuple[float, float]:
        """(forward, backward) roofline seconds of segment ``u`` (tp=1) for ``b`` sequences in ``dtype``."""
        i, first, end = self.rows[u][:3]
        key = (self.names[i], first, end, b, dtype)
        got = self._times.get(key)
        if got is None:
            nodes = self.costs.part(self.names[i], 1, False).nodes
            share = 1.0 if end is not None else self.rows[u][6]  # a half of a part without segments
            f = bw = 0.0
            for flops, bflops, act, weight, *_ in (nodes[first:end] if end is not None else nodes):
                x = roofline(self.profile, flops * b, bflops * b, act * b + weight, dtype)
                f, bw = f + x[0], bw + x[1]
            got = self._times[key] = (f * share, bw * share)
        return got

    def _shares(self) -> list[float]:
        one = [sum(self.time(u, 1, self.costs.dtype)) for u in range(len(self.rows))]
        total: dict[int, list[float]] = {}
        for u, seg in enumerate(self.rows):
            total.setdefault(seg[0], []).append(one[u])
        return [seg[6] if seg[2] is None else one[u] / sum(total[seg[0]]) if sum(total[seg[0]]) > 0
                else 1 / len(total[seg[0]]) for u, seg in enumerate(self.rows)]
