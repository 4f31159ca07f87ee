"""``fxpar calibrate`` (:mod:`fxpar.runtime.calibrate`, :mod:`fxpar.cli.calibrate`): the quick calibration on
two forked gloo ranks writes a profile whose figures are positive and whose predicted all-reduce of 1 MB on
two ranks is within 3x of timing that all-reduce directly on a separate pair of ranks; the in-group path
(the one torchrun takes) measures every collective kind on the ranks there are."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from fxpar.cli import main
from fxpar.cost.profiles import KINDS, load_profile
from fxpar.runtime.calibrate import AFTER_COMPUTE
from fxpar.testing import multiproc

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # timings: measured alone
pool2 = multiproc.rank_pool(2, shared=True)
MB = 2**20


def direct_all_reduce(nbytes: int, calls: int = 20) -> float:
    """Median seconds of ``calls`` all-reduces of ``nbytes`` on this pool's ranks (the slowest rank's), each
    after the calibration's compute gap (as a training step reaches its collectives)."""
    import torch.distributed as dist

    from fxpar.runtime.calibrate import _busy

    x = torch.ones(nbytes // 4)
    for _ in range(3):
        dist.all_reduce(x)
    busy = _busy(AFTER_COMPUTE, torch.device("cpu"))
    times = []
    for _ in range(calls):
        dist.barrier()
        busy()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def in_group_measurements() -> dict:
    from fxpar.runtime.calibrate import rank_measurements

    return rank_measurements(groups=(2,), sizes=(4096, MB), budget=0.01, share_counts=(1, 2), share_seconds=0.06,
                             concurrent=True)


def test_quick_calibration_writes_a_usable_profile(tmp_path, pool2):
    out = tmp_path / "profile.json"
    threads = torch.get_num_threads()
    t = time.perf_counter()
    try:
        assert main(["calibrate", "--world", "2", "--quick", "--out", str(out), "--timeout", "120"]) == 0
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t
    assert seconds < 30, f"--quick took {seconds:.1f} s"
    p = load_profile(str(out))
    assert p.flops["fp32"] > 0 and p.mem_bw > 0 and p.op_overhead > 0 and p.memory > 0
    assert p.intra.bandwidth > 0 and p.intra.latency >= 0 and p.compute_share[1] == pytest.approx(1.0)
    assert set(p.collectives) == set(KINDS) and all(b > 0 for t in p.collectives.values() for _, b in t.values())
    assert json.loads(out.read_text())["measurements"]["world"] == 2
    # the host's speed around each one-process measurement: its figures are read at the median of them
    host = json.loads(out.read_text())["measurements"]["host_speed"]
    assert host["reference_s"] == statistics.median(host["samples"]) > 0 and host["spread"] >= 1.0
    assert len(host["samples"]) >= 2 * 6  # before and after each of the six one-process measurements
    # what a training step pays besides matmuls: elementwise ops, the optimizer, first touch of big outputs
    assert p.elementwise_rate > 0 and p.optimizer_entry_time > 0 and not p.comm_overlaps
    assert p.fresh_threshold == 0 or (p.fresh_bw > 0 and p.fresh_time(p.fresh_threshold) > 0)
    # fxpar's own costs on its runtime's code paths (fxpar.runtime.calibrate_runtime): every kind of its
    # collective ops, the DP engine's buckets and ZeRO-3's gathers, the optimizer's fixed costs (--quick: no pipeline)
    assert set(p.collective_call) == {"all_reduce", "all_gather", "reduce_scatter", "ep_counts", "ep_dispatch",
                                      "ep_combine"}
    assert all(a >= 0 and b >= 0 for a, b in p.collective_call.values())
    # measured (a difference of two timings: 0 where it is below this host's noise, never negative)
    runtime = json.loads(out.read_text())["measurements"]["runtime"]
    assert {"bucket_copy", "gather_copy", "optimizer_tensor"} <= set(runtime), runtime
    assert all(x >= 0 for x in (*p.bucket_copy, *p.gather_copy, *p.optimizer_tensor))
    assert p.gather_scratch <= 0.05  # fxpar's gloo gathers broadcast into the output (gloo's own: 1.0 beside it)
    assert p.pipeline_action == {} and p.comm_share == {}  # --quick on 2 ranks: neither
    predicted = p.collective_time("all_reduce", MB, 2, inter_node=False)
    measured = max(pool2.run(direct_all_reduce, MB, timeout=60))
    assert measured / 3 < predicted < 3 * measured, (predicted, measured)


def test_in_group_path_measures_every_kind(pool2):
    got = pool2.run(in_group_measurements, timeout=60)
    m = got[0]
    assert set(m["compute_share"]) == {1, 2} and m["compute_share"][1] == 1.0
    for kind in KINDS:
        sizes = [x for x, _ in m["times"][kind][2]]
        assert sizes == [4096, MB] and all(s > 0 for _, s in m["times"][kind][2]), kind
    assert m["concurrent"] == {}  # two ranks: one group, nothing runs beside it
    assert m["after_compute_s"] == AFTER_COMPUTE > 0  # gloo: each timed call follows compute
    assert got[1]["times"]["all_reduce"][2] and got[1]["times"]["all_reduce"][2][1][1] > 0


def starts_of_timed_calls(after: float) -> list[float]:
    """The start times of the calls ``_time_collective`` makes of an all-reduce, ``after`` seconds of compute
    before each timed one."""
    import torch.distributed as dist

    from fxpar.runtime.calibrate import _time_collective

    starts, x = [], torch.ones(16)

    def op():
        starts.append(time.perf_counter())
        dist.all_reduce(x)
    _time_collective(op, dist.group.WORLD, torch.device("cpu"), budget=0.0, after=after)
    return starts


def test_each_timed_collective_follows_the_compute_gap(pool2):
    starts = pool2.run(starts_of_timed_calls, 0.02, timeout=60)[0]
    timed = starts[2:]  # the warm-up and the probe come first, back to back
    assert len(timed) >= 7
    gaps = [b - a for a, b in zip(timed, timed[1:])]
    assert min(gaps) >= 0.02, gaps


def test_measurements_are_read_at_the_calibration_host_speed():
    # a rate taken while the host ran at twice the reference time (half speed) doubles, a time halves; the
    # rounds' median of every figure is kept (fxpar.runtime.calibrate)
    from fxpar.runtime.calibrate import _median_floats, _scale_floats

    rate, secs = {"flops": 10.0, "by_size": {256: 4.0}, "n": 3}, {"forward": 2e-6, "pair": (1.0, 2)}
    _scale_floats(rate, 2.0)
    _scale_floats(secs, 0.5)
    assert rate == {"flops": 20.0, "by_size": {256: 8.0}, "n": 3} and secs == {"forward": 1e-6, "pair": (0.5, 2)}
    rounds = [{"a": 1.0, "b": {"c": 5.0}}, {"a": 3.0, "b": {"c": 1.0}}, {"a": 2.0, "b": {"c": 9.0}}]
    _median_floats(rounds[0], rounds)
    assert rounds[0] == {"a": 2.0, "b": {"c": 5.0}}
