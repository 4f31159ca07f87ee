"""The one makespan: a pipeline schedule's step time as the critical path of its action DAG (the
planner's Estimate reads :func:`critical_path`; compile's predicted step and the pipeline warning's bubble
read :func:`makespan` on their orders; :func:`fxpar.ir.schedule.simulate` only checks a schedule for
deadlocks), and the one walk of a rank's schedule for its memory peaks (:func:`walk`).

The DAG of :func:`fxpar.ir.schedule.build_schedule`'s actions (nodes: F/B/I/W of a stage and microbatch;
edges: the data dependencies and each rank's own order) is built once per ``(schedule, pp, m, v)`` with
networkx and kept; a step's makespan is its longest path with each action's duration on the node (an edge
into an action from another rank adds the point-to-point transfer time), the same model as
:func:`fxpar.ir.schedule.simulate`. The longest path is evaluated on networkx's topological order of the
cached graph (one pass over the edges; results cached per rounded costs), so thousands of plans can be
priced. Schedules too large to build cheaply (``EXACT_LIMIT`` actions) get a closed form instead: ``m``
times the busiest rank's per-microbatch time, plus the warm-up/cool-down ``(pp - 1)`` times that over the
stages per rank (gpipe/1f1b: 1; interleaved: 1/v; zero-bubble: the input-gradient share, 1/v), plus the
transfers on the path.

It also gives, per rank, the microbatches of each stage alive at the rank's activation peaks, so the
planner can price activation memory for any per-stage bytes without walking the schedule again.
"""

from __future__ import annotations

from functools import lru_cache

import networkx as nx

from fxpar.ir.schedule import (
    Action,
    build_schedule,
    dependencies,
    normalize_schedule,
    schedule_record,
    stage_to_rank,
    stages_per_rank,
)

EXACT_LIMIT = 2500  # actions: above this, the closed form (building torch's orders gets slow)

__all__ = ["EXACT_LIMIT", "closed_form", "critical_path", "makespan", "moments", "n_actions", "peak_activation",
           "schedule_dag", "walk"]


def n_actions(schedule: str, pp: int, m: int, v: int) -> int:
    return schedule_record(schedule).actions_per_microbatch * pp * v * m


@lru_cache(maxsize=256)
def schedule_dag(schedule: str, pp: int, m: int, v: int) -> tuple[nx.DiGraph, dict[int, list[Action]], list[int]]:
    """The DAG of the schedule's actions (``cross`` edges go between ranks), the orders and the placement."""
    name = normalize_schedule(schedule)
    n_stages = pp * stages_per_rank(name, v)
    order = build_schedule(name, pp, m, n_stages)
    place = stage_to_rank(name, pp, n_stages)
    return _graph(order, place), order, place


def _graph(order: dict[int, list[Action]], place: list[int]) -> nx.DiGraph:
    """The DAG of per-rank ``order`` over stages placed by ``place``."""
    n_stages = len(place)
    g = nx.DiGraph()
    made: dict[tuple[str, int, int], Action] = {}  # ("F"|"G"|"I", stage, mb) -> the action
    for acts in order.values():
        for a in acts:
            g.add_node(a)
            made[(a.kind, a.stage, a.mb)] = a
            if a.kind in ("B", "I"):
                made[("G", a.stage, a.mb)] = a
    for r, acts in order.items():
        for prev, a in zip(acts, acts[1:]):
            g.add_edge(prev, a, cross=False)
        for a in acts:
            for dep in dependencies(a, n_stages):
                src = made[dep]
                g.add_edge(src, a, cross=place[src.stage] != r)
    return g


@lru_cache(maxsize=256)
def _compiled(schedule: str, pp: int, m: int, v: int) -> tuple:
    """The DAG as index arrays in topological order: kinds, stages, ranks, predecessor lists."""
    g, _, place = schedule_dag(schedule, pp, m, v)
    return _arrays(g, place)


def _arrays(g: nx.DiGraph, place: list[int]) -> tuple:
    topo = list(nx.topological_sort(g))
    index = {a: i for i, a in enumerate(topo)}
    preds = [tuple((index[p], g.edges[p, a]["cross"]) for p in g.predecessors(a)) for a in topo]
    return tuple(topo), tuple(preds), tuple(place[a.stage] for a in topo)


def _per_stage(x, n: int) -> list[float]:
    return [float(x)] * n if isinstance(x, (int, float)) else [float(y) for y in x]


def critical_path(schedule: str, pp: int, m: int, v: int, F, B, W=None, comm: float = 0.0,
                  exact: bool | None = None) -> tuple[float, float]:
    """``(makespan, bubble)`` of one step: per-stage forward ``F``, backward ``B`` (input + weight
    gradient) and weight-gradient ``W`` seconds (lists of pp*v, or one number for all), ``comm`` seconds
    per transfer between ranks. ``bubble``: the fraction of ``pp * makespan`` the ranks idle.
    ``exact=None``: the DAG up to :data:`EXACT_LIMIT` actions, the closed form above."""
    name = normalize_schedule(schedule)
    v = stages_per_rank(name, v)
    n = pp * v
    f, b = _per_stage(F, n), _per_stage(B, n)
    w = _per_stage(W, n) if W is not None else [x / 2 for x in b]
    if exact is None:
        exact = n_actions(name, pp, m, v) <= EXACT_LIMIT
    if not exact:
        return closed_form(name, pp, m, v, f, b, w, comm)
    key = (name, pp, m, v, _round(f), _round(b), _round(w), round(comm, 12))
    return _exact(key)


def _round(xs: list[float]) -> tuple[float, ...]:
    return tuple(float(f"{x:.12g}") for x in xs)


@lru_cache(maxsize=65536)
def _exact(key: tuple) -> tuple[float, float]:
    name, pp, m, v, f, b, w, comm = key
    return _longest(*_compiled(name, pp, m, v), pp, f, b, w, comm)


def makespan(actions: dict[int, list[Action]], place: list[int], F, B, W=None,
             comm: float = 0.0) -> tuple[float, float]:
    """``(makespan, bubble)`` of per-rank orders ``actions`` (a schedule already checked for deadlocks, as
    compile's are) over stages placed by ``place``: the critical path of :func:`critical_path`, on these
    orders rather than a schedule's name."""
    n = len(place)
    f, b = _per_stage(F, n), _per_stage(B, n)
    w = _per_stage(W, n) if W is not None else [x / 2 for x in b]
    pp = max([max(place, default=-1) + 1, *(r + 1 for r in actions)])
    return _longest(*_arrays(_graph(actions, list(place)), list(place)), pp, f, b, w, comm)


def _longest(topo, preds, ranks, pp: int, f, b, w, comm: float) -> tuple[float, float]:
    """The longest path through the DAG's index arrays with each action's duration, and the bubble."""
    dur = {"F": f, "B": b, "W": w, "I": [x - y for x, y in zip(b, w)]}
    end = [0.0] * len(topo)
    busy = [0.0] * pp
    for i, a in enumerate(topo):
        start = 0.0
        for j, cross in preds[i]:
            t = end[j] + comm if cross else end[j]
            if t > start:
                start = t
        d = dur[a.kind][a.stage]
        end[i] = start + d
        busy[ranks[i]] += d
    makespan = max(end, default=0.0)
    return makespan, (1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0)


def closed_form(schedule: str, pp: int, m: int, v: int, f: list[float], b: list[float], w: list[float],
                comm: float) -> tuple[float, float]:
    """The makespan without the DAG: ``m`` x the busiest rank's microbatch + the warm-up and cool-down
    + the transfers on the path (exact for gpipe/1f1b/interleaved with equal stages; within a few per
    cent of the DAG for the zero-bubble schedules)."""
    name = normalize_schedule(schedule)
    place = stage_to_rank(name, pp, pp * v)
    per = [0.0] * pp
    wr = [0.0] * pp
    for s, r in enumerate(place):
        per[r] += f[s] + b[s]
        wr[r] += w[s]
    top = max(per)
    mean = sum(per) / pp
    rec = schedule_record(name)
    form = rec.closed_forms[0]
    hops = 2 * (pp * v - 1) - (2 if rec.placement == "v" else 0)  # the V's turn stays on one rank
    if form == "gpipe":
        fill = (pp - 1) * mean
        hops = 2 * (pp - 1)
    elif form == "1f1b":
        fill = (pp - 1) * mean
        hops = 2 * (pp - 1) + (m - 1) * 2 * (1 - 1 / pp)  # steady state waits a transfer each way
    elif form == "interleaved":
        fill = (pp - 1) * mean / v
    else:  # zero bubble: the weight gradients fill the cool-down
        fill = (pp - 1) * (mean - 2 * sum(wr) / pp) / v
    makespan = m * top + max(fill, 0.0) + hops * comm if pp > 1 else m * top
    return makespan, (1.0 - m * sum(per) / (pp * makespan) if makespan > 0 else 0.0)


def walk(actions: list[Action], stages: list[int]) -> list[tuple]:
    """The one walk of a rank's schedule for memory: the moments at which what the rank holds can peak,
    running ``actions`` (its order) over its ``stages`` (in stage order): at each forward's end, at each
    backward (B or I) before it frees its microbatch, and at the end, ``(microbatches alive per stage, the
    index of the stage whose backward runs or -1, whether each stage's weight gradients exist yet, forwards
    done per stage)``. A microbatch lives from its forward to its backward (its weight backward where the
    input and weight backward are split)."""
    pos = {s: i for i, s in enumerate(stages)}
    live, done, fwd = [0] * len(stages), [0] * len(stages), [0] * len(stages)
    split = {(a.stage, a.mb) for a in actions if a.kind == "W"}
    out = []
    for a in actions:
        i = pos[a.stage]
        fwd[i] += a.kind == "F"
        live[i] += a.kind == "F"
        if a.kind in ("F", "B", "I"):
            out.append((tuple(live), i if a.kind != "F" else -1, tuple(done), tuple(fwd)))
        if a.kind == "W" or (a.kind == "B" and (a.stage, a.mb) not in split):
            live[i] -= 1
            done[i] = 1
    out.append((tuple(live), -1, tuple(done), tuple(fwd)))
    return out


@lru_cache(maxsize=1024)
def moments(name: str, pp: int, m: int, v: int) -> tuple:
    """Per rank, the moments of its schedule that can hold its memory peak (:func:`walk`), dominated
    moments dropped (a later moment with the same running backward and at least as much of each kept)."""
    _, order, place = schedule_dag(name, pp, m, v)
    out = []
    for r in range(pp):
        seen: dict = {}  # (live, backward, done) -> forwards done (they only grow: the latest wins)
        for live, t, done, fwd in walk(order[r], [s for s in range(len(place)) if place[s] == r]):
            seen[(live, t, done)] = fwd
        xs = [(k[0], k[1], k[2], f) for k, f in seen.items()]
        keep = [x for x in xs if not any(y != x and y[1] == x[1] and all(
            all(p >= q for p, q in zip(y[j], x[j])) for j in (0, 2, 3)) for y in xs)]
        out.append(tuple(keep))
    return tuple(out)


def peak_activation(schedule: str, pp: int, m: int, v: int, kept: list[list[float]],
                    transient: list[list[float]], exact: bool | None = None) -> list[float]:
    """Peak activation bytes per rank: ``kept[r][i]`` / ``transient[r][i]`` per microbatch of rank r's
    i-th stage (in stage order), at the moments of :func:`walk`. Above :data:`EXACT_LIMIT`: the in-flight bound of
    the schedule's warm-up."""
    name = normalize_schedule(schedule)
    v = stages_per_rank(name, v)
    if exact is None:
        exact = n_actions(name, pp, m, v) <= EXACT_LIMIT
    if exact:
        at = moments(name, pp, m, v)
        return [max(sum(c * k for c, k in zip(live, kept[r])) + (transient[r][t] if t >= 0 else 0.0)
                    for live, t, _, _ in at[r]) for r in range(pp)]
    out, form = [], schedule_record(name).closed_forms[1]
    for r in range(pp):
        if form == "gpipe":
            flight = m
        elif form == "1f1b":
            flight = min(m, pp - r)
        elif form == "interleaved":  # the extra warm-up round of chunks
            flight = min(m, pp - r + (pp - 1) / v)
        else:  # zero-bubble schedules hold pp microbatches on every rank
            flight = min(m, pp)
        out.append(flight * sum(kept[r]) + max(transient[r], default=0.0))
    return out
