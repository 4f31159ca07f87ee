"""The moments of a pipeline schedule at which a rank's memory can peak, and the peaks they give.

A rank's activation memory at a moment is what its live microbatches keep for backward, plus the
transient of a backward running then (recomputed forward, gradients alive at once), plus the program's
outputs made so far (every microbatch's are kept to the step's end); the gradients of the parameters
exist from a stage's first backward on. GPipe's peak is at its first backward, before any gradient;
1F1B's later backwards hold as many microbatches and the gradients too. Used by
:mod:`fxpar.planner.price`; cached per schedule, pipeline size, microbatches and virtual stages.
"""

from __future__ import annotations

from functools import lru_cache

from fxpar.planner.schedule_dag import peak_activation, schedule_dag

__all__ = ["activation_peaks", "moments"]


def activation_peaks(name: str, pp: int, m: int, v: int, mine, kept, trans, kout, params, exact: bool) -> list[tuple]:
    """Per rank: its activation peak (kept microbatches, the backward's transient, the outputs made so
    far), and its peak counting also the parameter gradients (4 bytes per entry) its backwards have made
    by then, at every moment of its schedule (:func:`moments`); above the exact limit, the in-flight
    bound with every microbatch's outputs and, but for GPipe, the gradients held through the steady state."""
    if not exact:
        base = peak_activation(name, pp, m, v, [[kept[s] for s in st] for st in mine],
                               [[trans[s] for s in st] for st in mine], exact=False)
        out = []
        for r, st in enumerate(mine):
            a, g = base[r] + m * sum(kout[s] for s in st), 4 * sum(params[s] for s in st)
            out.append((a, max(a, g + m * sum(kout[s] for s in st)) if name == "gpipe" else a + g))
        return out
    out = []
    for r, st in enumerate(mine):
        got = [0.0, 0.0]
        grads = [4 * params[s] for s in st]
        for live, t, done, fwd in moments(name, pp, m, v)[r]:
            a = sum(c * kept[s] + f * kout[s] for c, f, s in zip(live, fwd, st)) + (trans[st[t]] if t >= 0 else 0)
            got = [max(got[0], a), max(got[1], a + sum(g for d, g in zip(done, grads) if d))]
        out.append(tuple(got))
    return out


@lru_cache(maxsize=1024)
def moments(name: str, pp: int, m: int, v: int) -> tuple:
    """Per rank, the moments of its schedule that can hold its memory peak: (microbatches alive per local
    stage, the stage whose backward runs or -1, whether each stage's weight gradients exist, forwards done
    per stage), at each forward's end, each backward, and the end; dominated moments dropped."""
    _, order, place = schedule_dag(name, pp, m, v)
    out = []
    for r in range(pp):
        mine = [s for s in range(len(place)) if place[s] == r]
        pos = {s: i for i, s in enumerate(mine)}
        live, done, fwd = [0] * len(mine), [0] * len(mine), [0] * len(mine)
        split = {(a.stage, a.mb) for a in order[r] if a.kind == "W"}
        seen: dict = {}  # (live, backward, done) -> forwards done (they only grow: the latest wins)
        for a in order[r]:
            i = pos[a.stage]
            fwd[i] += a.kind == "F"
            live[i] += a.kind == "F"
            if a.kind in ("F", "B", "I"):
                seen[(tuple(live), i if a.kind != "F" else -1, tuple(done))] = tuple(fwd)
            if a.kind == "W" or (a.kind == "B" and (a.stage, a.mb) not in split):
                live[i] -= 1
                done[i] = 1
        seen[(tuple(live), -1, tuple(done))] = tuple(fwd)
        xs = [(k[0], k[1], k[2], f) for k, f in seen.items()]
        keep = [x for x in xs if not any(y != x and y[1] == x[1] and all(
            all(p >= q for p, q in zip(y[j], x[j])) for j in (0, 2, 3)) for y in xs)]
        out.append(tuple(keep))
    return tuple(out)
