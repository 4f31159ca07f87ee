"""Pipeline schedules: complete, dependency-ordered, deadlock-free orders, known bubble figures, clear errors."""

from __future__ import annotations

import pytest

from fxpar.ir.errors import PlanError
from fxpar.ir.schedule import (
    SCHEDULES,
    Action,
    build_schedule,
    check_actions,
    normalize_schedule,
    simulate,
    stage_to_rank,
    stages_per_rank,
    validate,
)


def _cases():
    for name in SCHEDULES:
        for pp in (1, 2, 4):
            for m in sorted({1, 2, pp, 2 * pp, 3 * pp}):
                yield name, pp, m
    for name in ("1f1b", "interleaved_1f1b", "zbv", "interleaved_zb"):
        for m in (3, 8, 16):
            yield name, 8, m


CASES = list(_cases())


def _build(name, pp, m, virtual=None):
    n = pp * stages_per_rank(name, virtual)
    return build_schedule(name, pp, m, n), stage_to_rank(name, pp, n), n


def _deps(a: Action, n_stages: int):
    """Data dependencies, written out independently of the module under test."""
    if a.kind == "F":
        return [("F", a.stage - 1, a.mb)] if a.stage else []
    if a.kind == "W":
        return [("I", a.stage, a.mb)]
    deps = [("F", a.stage, a.mb)]
    if a.stage + 1 < n_stages:
        deps.append(("BI", a.stage + 1, a.mb))
    return deps


def _matches(a: Action, dep) -> bool:
    kind, s, mb = dep
    return (a.stage, a.mb) == (s, mb) and (a.kind in ("B", "I") if kind == "BI" else a.kind == kind)


@pytest.mark.parametrize("name,pp,m", CASES)
def test_order_is_complete_ordered_and_deadlock_free(name, pp, m):
    order, placement, n = _build(name, pp, m)
    assert sorted(order) == list(range(pp))
    # completeness: each (stage, mb) has one F and one B, or one I and one W, on the owning rank
    count = {}
    for rank, acts in order.items():
        for a in acts:
            assert isinstance(a, Action) and a.kind in "FBIW"
            assert placement[a.stage] == rank, f"{a} on rank {rank}, stage lives on {placement[a.stage]}"
            count[(a.kind, a.stage, a.mb)] = count.get((a.kind, a.stage, a.mb), 0) + 1
    assert all(c == 1 for c in count.values()), "an action is repeated"
    for s in range(n):
        for mb in range(m):
            kinds = {k for k in "FBIW" if (k, s, mb) in count}
            assert kinds in ({"F", "B"}, {"F", "I", "W"}), (s, mb, kinds)
    assert len(count) == sum(len(a) for a in order.values())
    # dependency order within each rank: a dependency that lives on the same rank comes earlier
    for rank, acts in order.items():
        for i, a in enumerate(acts):
            for dep in _deps(a, n):
                if placement[dep[1]] == rank:
                    assert any(_matches(b, dep) for b in acts[:i]), f"rank {rank}: {a} before its {dep}"
    # the simulation finishes, and respects every cross-rank dependency with the communication delay
    comm = 0.25
    res = simulate(order, placement, comm=comm)
    assert res.makespan > 0 and 0.0 <= res.bubble < 1.0
    assert len(res.times) == len(count)
    by_key = {(a.kind, a.stage, a.mb): t for a, t in res.times.items()}
    for a, (start, end) in res.times.items():
        for kind, s, mb in _deps(a, n):
            kinds = ("B", "I") if kind == "BI" else (kind,)
            dep_end = min(by_key[(k, s, mb)][1] for k in kinds if (k, s, mb) in by_key)
            delay = comm if placement[s] != placement[a.stage] else 0.0
            assert start >= dep_end + delay - 1e-9, (a, kind, s, mb)


def test_single_rank_is_a_simple_order():
    assert build_schedule("gpipe", 1, 3) == {0: [Action("F", 0, 0), Action("F", 0, 1), Action("F", 0, 2),
                                                 Action("B", 0, 0), Action("B", 0, 1), Action("B", 0, 2)]}
    assert build_schedule("1f1b", 1, 2) == {0: [Action("F", 0, 0), Action("B", 0, 0),
                                                Action("F", 0, 1), Action("B", 0, 1)]}
    for name in SCHEDULES:
        order, placement, _ = _build(name, 1, 4)
        assert simulate(order, placement).bubble == 0.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, m):
    order, placement, n = _build(name, pp, m)
    res = simulate(order, placement, {"F": [1.0] * n, "B": [2.0] * n})
    assert res.makespan == pytest.approx(3 * (m + pp - 1))
    assert res.bubble == pytest.approx((pp - 1) / (m + pp - 1))
    assert res.busy == [pytest.approx(3 * m)] * pp


def test_1f1b_with_fewer_microbatches_than_ranks_shrinks_the_warmup():
    order = build_schedule("1f1b", 4, 2)
    assert order[0] == [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)]
    assert order[3] == [Action("F", 3, 0), Action("B", 3, 0), Action("F", 3, 1), Action("B", 3, 1)]


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("mult", [1, 2, 3])
def test_interleaved_and_zero_bubble_beat_1f1b(pp, mult):
    m = mult * pp
    base = simulate(*_build("1f1b", pp, m)[:2]).bubble
    for name, virtual in (("interleaved_1f1b", 2), ("interleaved_1f1b", 4), ("interleaved_zb", 2),
                          ("zbv", 2)):
        order, placement, n = _build(name, pp, m, virtual)
        bubble = simulate(order, placement).bubble  # defaults: F=1, I=W=1, B=2 per stage
        assert bubble < base, (name, virtual, pp, m, bubble, base)
    # Megatron's figure for interleaving v stages per rank: (p-1) / (v*m + p-1)
    order, placement, _ = _build("interleaved_1f1b", pp, m, 2)
    assert simulate(order, placement).bubble == pytest.approx((pp - 1) / (2 * m + pp - 1))


def test_zero_bubble_beats_1f1b_with_few_microbatches():
    for pp, m in ((2, 1), (4, 1), (4, 2), (8, 2)):
        base = simulate(*_build("1f1b", pp, m)[:2]).bubble
        for name in ("zbv", "interleaved_zb"):
            assert simulate(*_build(name, pp, m)[:2]).bubble < base


def test_interleaved_with_more_stages_per_rank():
    for v in (1, 3, 4):
        order, placement, n = _build("interleaved_1f1b", 4, 8, v)
        assert n == 4 * v and placement == [s % 4 for s in range(n)]
        assert simulate(order, placement).bubble == pytest.approx(3 / (v * 8 + 3))
    order = build_schedule("interleaved_zb", 2, 4, 6)
    assert {a.stage for a in order[1]} == {1, 3, 5}


def test_names_placement_and_stages_per_rank():
    for alias, name in (("GPipe", "gpipe"), ("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved_1f1b"),
                        ("interleaved-1f1b", "interleaved_1f1b"), ("ZBVZeroBubble", "zbv"),
                        ("InterleavedZeroBubble", "interleaved_zb"), ("ScheduleGPipe", "gpipe")):
        assert normalize_schedule(alias) == name
    assert all(normalize_schedule(s) == s for s in SCHEDULES)
    with pytest.raises(PlanError, match="unknown pipeline schedule 'pipedream'.*gpipe, 1f1b"):
        normalize_schedule("pipedream")
    assert [stages_per_rank(s, None) for s in SCHEDULES] == [1, 1, 2, 2, 2, 2]
    assert stages_per_rank("interleaved_1f1b", 4) == 4
    with pytest.raises(PlanError, match="exactly 2 stages per rank"):
        stages_per_rank("zbv", 3)
    with pytest.raises(PlanError, match="one stage per rank"):
        stages_per_rank("1f1b", 2)
    assert stage_to_rank("1f1b", 4, 4) == [0, 1, 2, 3]
    assert stage_to_rank("interleaved_1f1b", 4, 8) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_to_rank("zbv", 4, 8) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert build_schedule("interleaved_1f1b", 2, 4).keys() == {0, 1}  # default: 2 stages per rank


@pytest.mark.parametrize("args,needles", [
    (("interleaved_1f1b", 4, 9, 8), ["'interleaved_1f1b'", "pp=4", "n_microbatches=9", "n_stages=8",
                                      "n_microbatches=8 or 10"]),
    (("interleaved_zb", 4, 14, 8), ["'interleaved_zb'", "n_microbatches=14", "rounds"]),
    (("interleaved_1f1b", 4, 8, 6), ["n_stages=6", "multiple of pp", "n_stages=4 or 8"]),
    (("zbv", 4, 8, 6), ["'zbv'", "n_stages=6", "2*pp = 8", "interleaved_zb"]),
    (("zbv", 2, 4, 8), ["n_stages=8", "set n_stages=4"]),
    (("gpipe", 4, 8, 8), ["one stage per rank", "n_stages must equal pp", "interleaved_1f1b"]),
    (("1f1b", 4, 0, 4), ["'1f1b'", "n_microbatches must be an int >= 1", "0"]),
    (("1f1b", 0, 4, 4), ["pp must be an int >= 1"]),
    (("1f1b", 2, 2.0, 2), ["n_microbatches must be an int"]),
    (("pipedream", 2, 2, 2), ["unknown pipeline schedule"]),
])
def test_invalid_combinations_raise_plan_errors(args, needles):
    with pytest.raises(PlanError) as info:
        validate(*args)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    with pytest.raises(PlanError):
        build_schedule(*args)


def test_valid_combinations_pass_validate():
    for m in (1, 3, 4, 5, 7, 8, 10, 12):  # <= 2*pp-1, or a multiple of the rounds
        validate("interleaved_1f1b", 4, m, 8)
    validate("1f1b", 8, 1, 8)
    validate("gpipe", 3, 5, None)


def test_simulate_names_the_blocked_ranks_on_deadlock():
    order = {0: [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
             1: [Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)]}
    with pytest.raises(PlanError) as info:
        simulate(order, [0, 1])
    msg = str(info.value)
    assert "deadlock" in msg
    assert "rank 0 at action 1 (B(stage=0, mb=0)) waits for B/I(stage=1, mb=0) on rank 1" in msg
    assert "rank 1 at action 0 (F(stage=1, mb=1)) waits for F(stage=0, mb=1) on rank 0" in msg


def test_simulate_costs_and_communication():
    order = build_schedule("gpipe", 2, 1)
    assert simulate(order, [0, 1], comm=0.5).makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    res = simulate(order, [0, 1], {"F": [1.0, 3.0], "B": [2.0, 6.0]})
    assert res.makespan == pytest.approx(12.0) and res.busy == [3.0, 9.0]
    assert res.bubble == pytest.approx(1 - 12 / 24)
    # B defaults to I + W when only those are given
    assert simulate(order, [0, 1], {"I": [2.0, 2.0], "W": [1.0, 1.0]}).makespan == pytest.approx(8.0)
    with pytest.raises(PlanError, match="must list 2 non-negative durations"):
        simulate(order, [0, 1], {"F": [1.0]})
    with pytest.raises(PlanError, match="unknown kinds"):
        simulate(order, [0, 1], {"X": [1.0, 1.0]})
    with pytest.raises(PlanError, match="not a compute action of a stage on rank 1"):
        simulate({0: [], 1: [Action("F", 0, 0)]}, [0, 1])


def test_check_actions_reports_broken_orders():
    placement = [0, 1]
    good = build_schedule("1f1b", 2, 2)
    check_actions(good, placement, 2)
    missing_w = {0: [Action("F", 0, 0), Action("I", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    with pytest.raises(PlanError, match="need exactly B, or I and W"):
        check_actions(missing_w, placement, 1)
    with pytest.raises(PlanError, match="before F\\(stage=1, mb=0\\)"):
        check_actions({0: [Action("F", 0, 0), Action("B", 0, 0)],
                       1: [Action("B", 1, 0), Action("F", 1, 0)]}, placement, 1)
    with pytest.raises(PlanError, match="stage 1 is on rank 1"):
        check_actions({0: [Action("F", 1, 0)], 1: []}, placement, 1)


def test_gpipe_and_1f1b_agree_with_torch_and_placements_too():
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    class Stage:  # what the single-stage torch schedules read
        def __init__(self, pp):
            self.num_stages, self.stage_index, self.group_rank, self.group_size = pp, 0, 0, pp
            self.submod = None

    for pp, m in ((2, 2), (4, 4), (4, 8), (8, 12)):
        for name, cls in (("gpipe", ts.ScheduleGPipe), ("1f1b", ts.Schedule1F1B)):
            theirs = {r: [Action(a.computation_type.value, a.stage_index, a.microbatch_index)
                          for a in acts if a is not None and a.computation_type.value in "FB"]
                      for r, acts in cls(Stage(pp), m).pipeline_order.items()}
            ours = build_schedule(name, pp, m)
            # torch's Schedule1F1B.pipeline_order numbers the last rank's forwards from 1 (it starts the
            # steady phase with forward_mb += 1 even when there was no warm-up), so compare the other ranks
            # there; its real step() runs the last rank in the order we generate
            ranks = range(pp - 1) if name == "1f1b" else range(pp)
            assert [ours[r] for r in ranks] == [theirs[r] for r in ranks], (name, pp, m)
        for name, style in (("interleaved_1f1b", "loop"), ("zbv", "v")):
            mapping = generate_stage_to_rank_mapping(pp, 2 * pp, style=style)
            assert stage_to_rank(name, pp, 2 * pp) == [mapping[s] for s in range(2 * pp)]


def test_looped_bfs_runs_each_local_stage_breadth_first():
    # a schedule added by its record alone (torch's ScheduleLoopedBFS): rank r runs every microbatch's
    # forward through its first stage, then its second, and the backwards in the reverse order
    order, placement, n = _build("LoopedBFS", 2, 3)
    assert placement == [0, 1, 0, 1] and normalize_schedule("ScheduleLoopedBFS") == "looped_bfs"
    assert [(a.kind, a.stage) for a in order[0]] == [("F", 0)] * 3 + [("F", 2)] * 3 + [("B", 2)] * 3 + [("B", 0)] * 3
    # by hand (F=1, B=2): rank 1's forwards end at 7, its B(3) at 13, its B(1) at 15, 17, 19; rank 0's B(0)
    # wait on each of those: 15-17, 17-19, 19-21
    assert simulate(order, placement).makespan == 21.0
