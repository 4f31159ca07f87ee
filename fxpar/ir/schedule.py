"""Pipeline schedules as per-rank lists of compute actions, and an event simulator to check and cost them.

A schedule is ``{rank: [Action, ...]}``: the order in which each rank runs forward (F), full backward (B),
input-only backward (I) and weight-only backward (W) of (stage, microbatch) pairs: compute actions only (the
pipeline runtime routes activations and gradients between stages itself: no send/receive, no idle slots).

Design decisions:
- One :class:`Schedule` record per schedule (:data:`SCHEDULE_RECORDS`): a new schedule is one entry.
- gpipe and 1f1b are generated here: torch's ``Schedule1F1B`` refuses ``n_microbatches < pp``, which fxpar
  accepts (the warm-up shrinks). The others take the ``pipeline_order`` of their torch class, computed in
  ``__init__`` from the stage objects' indices and group size alone, so a stand-in stage (no process group,
  no module) is enough; only F/B/I/W are kept. The import is lazy (gpipe/1f1b need no torch.distributed).
- ``build_schedule`` validates its inputs and checks every order it returns for completeness and, with
  ``simulate``, for deadlock: a torch version that changes its generators cannot hand the runtime an order that
  hangs. Pure (no process group, no device), so in ``ir``: the runtime executes these orders, the cost model
  and the planner price them, the feasibility checks call ``validate``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from fxpar.ir.errors import PlanError

KINDS: tuple[str, ...] = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule. ``stages``: stages per rank if fixed, else None (any; default 2); ``placement``:
    ``"loop"`` (stage s on rank s % pp) or ``"v"`` (down the ranks and back up); ``split_backward``: backward
    runs as I and W actions (two autograd passes); ``torch_class``: the torch.distributed.pipelining class
    whose ``pipeline_order`` it takes (None: generated here); ``aliases``: other spellings (lower case, no
    separators); ``searched``: whether the planner's search tries it; ``closed_forms``: the closed forms
    (``fxpar.cost.schedule``: gpipe, 1f1b, interleaved, zero_bubble) of its makespan and of its microbatches
    in flight, used above the cost model's exact limit."""

    name: str
    stages: int | None
    placement: str = "loop"
    split_backward: bool = False
    torch_class: str | None = None
    aliases: tuple[str, ...] = ()
    searched: bool = True
    closed_forms: tuple[str, str] = ("interleaved", "interleaved")

    @property
    def actions_per_microbatch(self) -> int:  # compute actions per stage and microbatch: F, B or F, I, W
        return 3 if self.split_backward else 2


# The one table of schedules (read by build_schedule, the recompute pass, the cost model, the planner's search)
SCHEDULE_RECORDS: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", 1, closed_forms=("gpipe", "gpipe")),
    Schedule("1f1b", 1, aliases=("onefoneb",), closed_forms=("1f1b", "1f1b")),
    Schedule("interleaved_1f1b", None, torch_class="ScheduleInterleaved1F1B", aliases=("interleaved",)),
    Schedule("zbv", 2, placement="v", split_backward=True, torch_class="ScheduleZBVZeroBubble",
             aliases=("zbvzerobubble", "zerobubblev"), closed_forms=("zero_bubble", "zero_bubble")),
    Schedule("interleaved_zb", None, split_backward=True, torch_class="ScheduleInterleavedZeroBubble",
             aliases=("interleavedzerobubble", "zb1p"), closed_forms=("zero_bubble", "zero_bubble")),
    Schedule("looped_bfs", None, torch_class="ScheduleLoopedBFS", searched=False,
             closed_forms=("interleaved", "gpipe")),  # interleaved's fill, gpipe's m in flight
)}
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_RECORDS)
SPLIT_BACKWARD = frozenset(s.name for s in SCHEDULE_RECORDS.values() if s.split_backward)
_ALIASES = {key: s.name for s in SCHEDULE_RECORDS.values() for key in (s.name.replace("_", ""), *s.aliases)}


def schedule_record(name: str) -> Schedule:
    """The record of schedule ``name`` (any spelling :func:`normalize_schedule` takes)."""
    return SCHEDULE_RECORDS[normalize_schedule(name)]


@dataclass(frozen=True)
class Action:
    """One compute step: ``kind`` in F/B/I/W, on global (virtual) stage ``stage``, for microbatch ``mb``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}(stage={self.stage}, mb={self.mb})"


@dataclass
class SimResult:
    """What ``simulate`` found: total time, per-rank busy time, idle fraction and each action's (start, end)."""

    makespan: float
    busy: list[float]
    bubble: float
    times: dict[Action, tuple[float, float]] = field(default_factory=dict, repr=False)


@functools.lru_cache(maxsize=256)  # the planner asks for the same few names hundreds of thousands of times
def normalize_schedule(name: str) -> str:
    """The canonical name in SCHEDULES for ``name`` (case, '-', '_' and spaces ignored; torch's class names too)."""
    if not isinstance(name, str):
        raise PlanError(f"pipeline schedule must be a name (str), got {type(name).__name__} {name!r}; "
                        f"use one of {', '.join(SCHEDULES)}")
    key = re.sub(r"[^0-9a-z]", "", name.lower())
    if key.startswith("schedule"):  # torch's class names: ScheduleGPipe, ScheduleInterleaved1F1B, ...
        key = key[len("schedule"):]
    if key not in _ALIASES:
        raise PlanError(f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)} "
                        f"(aliases: GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, InterleavedZeroBubble)")
    return _ALIASES[key]


def stages_per_rank(schedule: str, virtual: int | None) -> int:
    """Stages each rank holds: 1 for gpipe/1f1b, ``virtual`` (default 2) for interleaved, exactly 2 for zbv."""
    name = normalize_schedule(schedule)
    if virtual is not None and (not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1):
        raise PlanError(f"schedule {name!r}: stages per rank must be an int >= 1, got {virtual!r}")
    fixed = SCHEDULE_RECORDS[name].stages
    if fixed == 1 and virtual not in (None, 1):
        raise PlanError(f"schedule {name!r} runs one stage per rank, got {virtual} stages per rank; "
                        f"use 'interleaved_1f1b' or 'interleaved_zb' for several stages per rank")
    if fixed is not None and virtual not in (None, fixed):
        raise PlanError(f"schedule {name!r} needs exactly {fixed} stages per rank (a V), got {virtual}; "
                        f"use 'interleaved_zb' for another number of stages per rank")
    return fixed or (2 if virtual is None else virtual)


def microbatches(plan) -> int:
    """Microbatches per data-parallel replica under ``plan``: its own count, else one per pipeline stage."""
    return plan.microbatches or plan.pp * stages_per_rank(normalize_schedule(plan.schedule), plan.virtual_stages)


def stage_to_rank(schedule: str, pp: int, n_stages: int) -> list[int]:
    """The rank of each stage: loop placement (s % pp), or for zbv the V (rank r holds r and 2*pp-1-r)."""
    name = normalize_schedule(schedule)
    _check_ints(name, pp=pp, n_stages=n_stages)
    if n_stages % pp:
        raise PlanError(f"schedule {name!r}: n_stages={n_stages} is not a multiple of pp={pp}; "
                        f"every rank must hold the same number of stages")
    if SCHEDULE_RECORDS[name].placement != "v":
        return [s % pp for s in range(n_stages)]
    # V: stages go down the ranks in even chunks and back up in odd chunks
    return [s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(n_stages)]


def _check_ints(name: str, **values) -> None:
    for key, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"schedule {name!r}: {key} must be an int >= 1, got {v!r}")


def _interleaved_ok(pp: int, m: int) -> bool:
    # torch's interleaved classes split the microbatches into max(1, m // pp) equal rounds
    return m % max(1, m // pp) == 0


def validate(schedule: str, pp: int, n_microbatches: int, n_stages: int | None) -> None:
    """Raise PlanError if ``schedule`` cannot run ``n_microbatches`` over ``n_stages`` stages on ``pp`` ranks.

    ``n_stages=None`` means the schedule's default (pp times its default stages per rank).
    """
    name = normalize_schedule(schedule)
    if n_stages is None:
        n_stages = pp * stages_per_rank(name, None) if isinstance(pp, int) else pp
    _check_ints(name, pp=pp, n_microbatches=n_microbatches, n_stages=n_stages)
    where = f"schedule {name!r} with pp={pp}, n_microbatches={n_microbatches}, n_stages={n_stages}"
    rec = SCHEDULE_RECORDS[name]
    if rec.stages == 1:
        if n_stages != pp:
            raise PlanError(f"{where}: {name} runs exactly one stage per rank, so n_stages must equal pp "
                            f"({pp}); set n_stages={pp}, or use 'interleaved_1f1b' for "
                            f"{n_stages / pp:g} stages per rank")
        return
    if rec.placement == "v":
        if n_stages != 2 * pp:
            raise PlanError(f"{where}: zbv places exactly 2 stages per rank in a V, so n_stages must be "
                            f"2*pp = {2 * pp}; set n_stages={2 * pp}, or use 'interleaved_zb'")
        return
    if n_stages % pp:
        lo, hi = (n_stages // pp) * pp, (n_stages // pp + 1) * pp
        fix = f"n_stages={hi}" if lo == 0 else f"n_stages={lo} or {hi}"
        raise PlanError(f"{where}: n_stages must be a multiple of pp so every rank holds the same number "
                        f"of stages; use {fix}")
    if not _interleaved_ok(pp, n_microbatches):
        rounds = n_microbatches // pp
        lo = next(m for m in range(n_microbatches, 0, -1) if _interleaved_ok(pp, m))
        hi = next(m for m in range(n_microbatches, 4 * n_microbatches + pp) if _interleaved_ok(pp, m))
        raise PlanError(f"{where}: interleaved schedules run the microbatches in max(1, n_microbatches // pp)"
                        f" = {rounds} equal rounds, and {n_microbatches} is not a multiple of {rounds}; "
                        f"use n_microbatches={lo} or {hi} (any value <= 2*pp-1 or a multiple of pp works)")


def build_schedule(schedule: str, pp: int, n_microbatches: int,
                   n_stages: int | None = None) -> dict[int, list[Action]]:
    """The compute actions of every rank in execution order (checked complete and deadlock-free)."""
    name = normalize_schedule(schedule)
    validate(name, pp, n_microbatches, n_stages)
    if n_stages is None:
        n_stages = pp * stages_per_rank(name, None)
    if SCHEDULE_RECORDS[name].torch_class is None:
        order = _GENERATED[name](pp, n_microbatches)
    else:
        order = _from_torch(name, pp, n_microbatches, n_stages)
    placement = stage_to_rank(name, pp, n_stages)
    try:
        check_actions(order, placement, n_microbatches)
        simulate(order, placement)
    except PlanError as e:  # only reachable if torch's generator changed under us
        raise PlanError(f"schedule {name!r} with pp={pp}, n_microbatches={n_microbatches}, "
                        f"n_stages={n_stages} produced an unusable order: {e}; pick another schedule "
                        f"or microbatch count") from e
    return order


def _gpipe(pp: int, m: int) -> dict[int, list[Action]]:
    # all forwards, then all backwards, in microbatch order
    return {r: [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
            for r in range(pp)}


def _one_f_one_b(pp: int, m: int) -> dict[int, list[Action]]:
    # rank r warms up with pp-1-r forwards (or m), then alternates one forward and one backward, then drains
    order = {}
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        acts += [Action("B", r, i) for i in range(m - warmup, m)]
        order[r] = acts
    return order


_GENERATED = {"gpipe": _gpipe, "1f1b": _one_f_one_b}  # the schedules without a torch class


class _StageStandIn:
    """What torch's schedule constructors read from a pipeline stage to compute ``pipeline_order``."""

    def __init__(self, stage_index: int, num_stages: int, group_rank: int, group_size: int):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_rank = group_rank
        self.group_size = group_size
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = None  # read by the torch.compile check of the zero-bubble classes
        self.stage_index_to_group_rank: dict[int, int] = {}


def _from_torch(name: str, pp: int, m: int, n_stages: int) -> dict[int, list[Action]]:
    try:
        from torch.distributed.pipelining import schedules as torch_schedules
    except ImportError as e:  # torch built without distributed
        raise PlanError(f"schedule {name!r} takes its order from torch.distributed.pipelining, which "
                        f"cannot be imported here ({e}); use 'gpipe' or '1f1b'") from e
    placement = stage_to_rank(name, pp, n_stages)
    stages = [_StageStandIn(s, n_stages, 0, pp) for s in range(n_stages) if placement[s] == 0]
    cls = getattr(torch_schedules, SCHEDULE_RECORDS[name].torch_class)
    try:
        torch_order = cls(stages, n_microbatches=m).pipeline_order
    except (ValueError, RuntimeError, AssertionError) as e:
        raise PlanError(f"schedule {name!r} with pp={pp}, n_microbatches={m}, n_stages={n_stages}: "
                        f"torch's {cls.__name__} refuses it: {e}") from e
    except (TypeError, AttributeError, KeyError) as e:  # a torch whose constructor reads more of the stage
        raise PlanError(f"schedule {name!r}: torch's {cls.__name__} could not be built from a stand-in "
                        f"stage in this torch version ({type(e).__name__}: {e}); use 'gpipe' or '1f1b'") from e
    order: dict[int, list[Action]] = {}
    for rank in range(pp):
        acts: list[Action] = []
        for a in torch_order.get(rank, []):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                kind = getattr(sub.computation_type, "value", str(sub.computation_type))
                if kind in KINDS:
                    acts.append(Action(kind, int(sub.stage_index), int(sub.microbatch_index)))
        order[rank] = acts
    return order


def check_actions(actions: dict[int, list[Action]], stage_to_rank: list[int], n_microbatches: int) -> None:
    """Raise PlanError unless every (stage, mb) has one F and one B (or one I and one W) on its owning rank,
    with F before its B/I and I before its W within the rank's list."""
    n_stages = len(stage_to_rank)
    seen: dict[tuple[str, int, int], int] = {}
    for rank, acts in actions.items():
        for pos, a in enumerate(acts):
            if a.kind not in KINDS or not 0 <= a.stage < n_stages or not 0 <= a.mb < n_microbatches:
                raise PlanError(f"rank {rank} action {pos} is {a}: kind must be one of {KINDS}, stage in "
                                f"0..{n_stages - 1}, mb in 0..{n_microbatches - 1}")
            if stage_to_rank[a.stage] != rank:
                raise PlanError(f"rank {rank} action {pos} is {a}, but stage {a.stage} is on rank "
                                f"{stage_to_rank[a.stage]}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise PlanError(f"rank {rank} runs {a} twice (actions {seen[key]} and {pos})")
            seen[key] = pos
            need = {"B": "F", "I": "F", "W": "I"}.get(a.kind)
            if need and (need, a.stage, a.mb) not in seen:
                raise PlanError(f"rank {rank} action {pos} is {a} before "
                                f"{Action(need, a.stage, a.mb)}, which must come first")
    for s in range(n_stages):
        for mb in range(n_microbatches):
            has = {k for k in KINDS if (k, s, mb) in seen}
            if "F" not in has:
                raise PlanError(f"no rank runs F(stage={s}, mb={mb})")
            if has not in ({"F", "B"}, {"F", "I", "W"}):
                raise PlanError(f"stage {s} mb {mb} has backward actions {sorted(has - {'F'})}; "
                                f"need exactly B, or I and W")


def simulate(actions: dict[int, list[Action]], stage_to_rank: list[int],
             cost: dict[str, list[float]] | None = None, comm: float = 0.0) -> SimResult:
    """Run the per-rank orders against the data dependencies and return makespan, busy time and bubble.

    Each rank runs its list strictly in order; an action starts when its rank is free and its inputs are
    done (plus ``comm`` when an input comes from another rank). ``cost`` gives per-stage durations per kind
    (defaults F=1, I=1, W=1, B=I+W). Raises PlanError naming every blocked rank if the orders deadlock.
    """
    n_stages = len(stage_to_rank)
    pp = max([max(stage_to_rank, default=-1) + 1, *(r + 1 for r in actions)])
    dur = _durations(cost or {}, n_stages)
    done: dict[tuple[str, int, int], tuple[int, float]] = {}  # ("F"|"G"|"I", stage, mb) -> (rank, end)
    times: dict[Action, tuple[float, float]] = {}
    busy = [0.0] * pp
    free = [0.0] * pp
    pos = {r: 0 for r in actions}
    for r, acts in actions.items():
        for a in acts:
            if a.kind not in KINDS or not 0 <= a.stage < n_stages or stage_to_rank[a.stage] != r:
                raise PlanError(f"simulate: rank {r} lists {a}, which is not a compute action of a stage "
                                f"on rank {r} (stage_to_rank={stage_to_rank})")
    progress = True
    while progress:
        progress = False
        for r, acts in actions.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                deps = dependencies(a, n_stages)
                if any(d not in done for d in deps):
                    break
                start = free[r]
                for d in deps:
                    dep_rank, end = done[d]
                    start = max(start, end + (comm if dep_rank != r else 0.0))
                end = start + dur[a.kind][a.stage]
                free[r] = end
                busy[r] += end - start
                times[a] = (start, end)
                if a.kind == "F":
                    done[("F", a.stage, a.mb)] = (r, end)
                else:
                    if a.kind in ("B", "I"):
                        done[("G", a.stage, a.mb)] = (r, end)
                    done[(a.kind, a.stage, a.mb)] = (r, end)
                pos[r] += 1
                progress = True
    blocked = [r for r, acts in actions.items() if pos[r] < len(acts)]
    if blocked:
        lines = []
        for r in blocked:
            a = actions[r][pos[r]]
            missing = [d for d in dependencies(a, n_stages) if d not in done]
            lines.append(f"rank {r} at action {pos[r]} ({a}) waits for "
                         + " and ".join(_dep_name(d, stage_to_rank) for d in missing))
        raise PlanError("simulate: the schedule deadlocks: " + "; ".join(lines)
                        + "; reorder so that every action's inputs are produced earlier")
    makespan = max(free, default=0.0)
    bubble = 1.0 - sum(busy) / (pp * makespan) if makespan > 0 else 0.0
    return SimResult(makespan=makespan, busy=busy, bubble=bubble, times=times)


def dependencies(a: Action, n_stages: int) -> list[tuple[str, int, int]]:
    """What ``a`` waits for: ``(kind, stage, mb)`` with kind F, I, or G (the B or I of the next stage)."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [("I", a.stage, a.mb)]
    deps = [("F", a.stage, a.mb)]
    if a.stage < n_stages - 1:
        deps.append(("G", a.stage + 1, a.mb))  # the B or I of the next stage
    return deps


def _dep_name(d: tuple[str, int, int], stage_to_rank: list[int]) -> str:
    kind, s, mb = d
    kind = "B/I" if kind == "G" else kind
    return f"{kind}(stage={s}, mb={mb}) on rank {stage_to_rank[s]}"


def _durations(cost: dict[str, list[float]], n_stages: int) -> dict[str, list[float]]:
    unknown = set(cost) - set(KINDS)
    if unknown:
        raise PlanError(f"simulate: cost has unknown kinds {sorted(unknown)}; use keys among {KINDS}")
    for k, v in cost.items():
        if len(v) != n_stages or any(x < 0 for x in v):
            raise PlanError(f"simulate: cost[{k!r}] must list {n_stages} non-negative durations (one per "
                            f"stage), got {list(v)}")
    dur = {k: [float(x) for x in cost.get(k, [1.0] * n_stages)] for k in ("F", "I", "W")}
    dur["B"] = [float(x) for x in cost["B"]] if "B" in cost else [i + w for i, w in zip(dur["I"], dur["W"])]
    return dur
