"""fxpar.cost.overheads: each term of fxpar's per-step runtime costs against a hand computation, nothing priced on
an unmeasured profile, and the new DeviceProfile fields surviving save / load."""

from __future__ import annotations

import dataclasses

import pytest

from fxpar.cost.overheads import StepCounts, overheads, runtime_fields
from fxpar.cost.profiles import PROFILES, Link, load_profile, profile_from_measurements

COUNTS = StepCounts(collectives={"all_reduce": (10, 4e6), "all_gather": (4, 1e6)}, schedule="1f1b", actions=16,
                    dp_buckets=3, dp_bucket_bytes=30e6, zero3_gathers=8, zero3_gather_bytes=2e6,
                    optimizer_tensors=20, optimizer_groups=2, busy_ranks=2, comm_time=0.5)


def measured(**kw):
    base = PROFILES["cpu"]
    return dataclasses.replace(
        base, name="t", intra=Link(1e9, 1e-5), inter=Link(1e9, 1e-5), compute_share={1: 1.0, 2: 1.0, 4: 0.5},
        collective_call={"all_reduce": (20e-6, 1e-10), "all_gather": (30e-6, 2e-10)},
        pipeline_action={"1f1b": 100e-6, "gpipe": 80e-6}, bucket_copy=(50e-6, 2e9), gather_copy=(40e-6, 4e9),
        optimizer_tensor=(5e-6, 30e-6), comm_share={2: 1.0, 4: 0.8, 8: 0.4}, **kw)


def test_each_term_by_hand():
    o = overheads(measured(), COUNTS)
    assert o.collective_calls == pytest.approx(10 * 20e-6 + 4e6 * 1e-10 + 4 * 30e-6 + 1e6 * 2e-10)
    assert o.pipeline == pytest.approx(16 * 100e-6)
    assert o.dp_buckets == pytest.approx(3 * 50e-6 + 30e6 / 2e9)
    assert o.zero3_gathers == pytest.approx(8 * 40e-6 + 2e6 / 4e9)
    assert o.optimizer == pytest.approx(20 * 5e-6 + 2 * 30e-6)
    assert o.contention == 0.0  # comm_share[2] = 1
    assert o.total == pytest.approx(o.collective_calls + o.pipeline + o.dp_buckets + o.zero3_gathers + o.optimizer)


def test_ranks_sharing_cores():
    """4 busy ranks: the runtime's terms at compute_share[4] = 0.5 (twice as long), the collectives at
    comm_share[4] = 0.8 (0.5 s priced -> 0.625 s: 0.125 s more); 8 busy: compute share 0.5 x 4/8 = 0.25 and
    comm share 0.4."""
    p, alone = measured(), overheads(measured(), COUNTS)
    four = overheads(p, dataclasses.replace(COUNTS, busy_ranks=4))
    assert four.pipeline == pytest.approx(2 * alone.pipeline)
    assert four.optimizer == pytest.approx(2 * alone.optimizer)
    assert four.contention == pytest.approx(0.5 / 0.8 - 0.5)
    eight = overheads(p, dataclasses.replace(COUNTS, busy_ranks=8))
    assert eight.dp_buckets == pytest.approx(4 * alone.dp_buckets)
    assert eight.contention == pytest.approx(0.5 / 0.4 - 0.5)


def test_unmeasured_prices_nothing():
    for name in ("h100-80gb", "cpu"):
        assert overheads(PROFILES[name], dataclasses.replace(COUNTS, busy_ranks=8)).total == 0.0
    # a schedule the profile did not measure, and no pipeline
    p = measured()
    assert overheads(p, dataclasses.replace(COUNTS, schedule="zbv")).pipeline == 0.0
    assert overheads(p, dataclasses.replace(COUNTS, schedule="")).pipeline == 0.0


def test_fields_round_trip(tmp_path):
    p = measured()
    assert load_profile(p.save(tmp_path / "p.json")) == p
    m = {"matmul": {"fp32": {"flops": 1e11}}, "memory_bandwidth": {"bytes_per_s": 2e10},
         "op_overhead": {"forward": 4e-6},
         "runtime": {"collective_call": {"all_reduce": [2e-5, 1e-10]}, "pipeline_action": {"zbv": 1e-4},
                     "bucket_copy": [5e-5, 2e9], "gather_copy": [4e-5, 4e9], "optimizer_tensor": [5e-6, 3e-5],
                     "comm_share": {"4": 0.8}}}
    got = profile_from_measurements(m)
    assert got.collective_call == {"all_reduce": (2e-5, 1e-10)} and got.pipeline_action == {"zbv": 1e-4}
    assert (got.bucket_copy, got.gather_copy, got.optimizer_tensor) == ((5e-5, 2e9), (4e-5, 4e9), (5e-6, 3e-5))
    assert got.comm_share == {4: 0.8}
    assert runtime_fields({}) == {}
    assert load_profile(got.save(tmp_path / "q.json")) == got


def test_collectives_slowed_by_the_ranks_outside_their_group():
    """On a host whose collectives run on the computing cores (gloo on a CPU: comm_overlaps False), a group of 2
    while 4 ranks compute runs at compute_share[4] / compute_share[2] = 0.5 (the calibration timed it with its 2
    ranks alone), a group of all 4 at 1 (no rank outside it: the case the calibration timed, whatever comm_share
    reads), a group of 2 never faster than the measured comm_share; a GPU host's
    collectives (copy engines) are not slowed; dp_bucket_count follows the engine's 1 MiB first bucket."""
    from fxpar.cost.overheads import comm_share, dp_bucket_count

    cpu = measured(comm_overlaps=False)
    assert comm_share(cpu, 4, 2) == pytest.approx(0.5)
    assert comm_share(cpu, 4, 4) == 1.0  # every busy rank in the group
    assert comm_share(dataclasses.replace(cpu, comm_share={4: 0.3}), 4, 2) == pytest.approx(0.3)
    assert comm_share(dataclasses.replace(cpu, comm_share={}), 4, 4) == 1.0
    assert comm_share(dataclasses.replace(measured(comm_overlaps=True), comm_share={}), 4, 2) == 1.0
    assert comm_share(cpu, 4) == pytest.approx(0.8)  # no group: the measured factor alone
    assert [dp_bucket_count(n) for n in (0, 2**20, 2**20 + 1, 2**20 + 25 * 2**20, 2**20 + 25 * 2**20 + 1)] \
        == [0, 1, 2, 2, 3]
