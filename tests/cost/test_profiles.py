"""Device profiles (:mod:`fxpar.cost.profiles`): the ring formulas of each collective against the alpha-beta
sums written out by hand, the measured table winning over the link (and where it does not), the roofline,
compute share, JSON round trips, how a profile is found and the errors when it is not, and profiles built
from calibration measurements (synthetic ones here; the real measurement is tests/runtime/test_calibrate.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fxpar.cost import profiles
from fxpar.cost.profiles import (
    PROFILES,
    DeviceProfile,
    Link,
    fit_alpha_beta,
    load_profile,
    profile_for_device,
    profile_from_measurements,
)
from fxpar.ir.errors import PlanError

INTRA, INTER = Link(bandwidth=300e9, latency=3e-6), Link(bandwidth=40e9, latency=9e-6)
MB = 2**20


def hand_profile(**kw) -> DeviceProfile:
    base = dict(name="hand", flops={"fp32": 1e12, "bf16": 4e12}, mem_bw=1e12, memory=10 * 2**30, ranks_per_node=8,
                intra=INTRA, inter=INTER, op_overhead=5e-6)
    return DeviceProfile(**{**base, **kw})


@pytest.mark.parametrize("n", [2, 4, 8, 64])
@pytest.mark.parametrize("inter", [False, True])
def test_ring_formulas_per_collective(n, inter):
    p, link = hand_profile(), (INTER if inter else INTRA)
    nbytes = 48 * MB
    ar = p.collective_time("all_reduce", nbytes, n, inter)
    assert ar == pytest.approx(2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth)
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert p.collective_time(kind, nbytes, n, inter) == pytest.approx(
            (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)
    assert p.collective_time("send", nbytes, n, inter) == pytest.approx(link.latency + nbytes / link.bandwidth)
    # an all-reduce costs what a reduce-scatter and an all-gather cost together
    rs_ag = p.collective_time("reduce_scatter", nbytes, n, inter) + p.collective_time("all_gather", nbytes, n, inter)
    assert ar == pytest.approx(rs_ag)


def test_one_rank_or_no_bytes_costs_nothing_and_unknown_kind_is_an_error():
    p = hand_profile()
    assert p.collective_time("all_reduce", MB, 1, False) == 0.0
    assert p.collective_time("all_gather", 0, 8, True) == 0.0
    with pytest.raises(PlanError, match="all_reduce"):
        p.collective_time("allreduce", MB, 2, False)


def test_measured_table_wins_inside_a_node():
    table = {"all_reduce": {2: (1e-4, 2e-9), 8: (7e-4, 4e-9)}}
    p = hand_profile(collectives=table)
    nbytes = 10 * MB
    for n, (a, b) in table["all_reduce"].items():  # measured sizes: the fit itself
        assert p.collective_time("all_reduce", nbytes, n, False) == pytest.approx(a + b * nbytes)
    # between measured sizes: between the two measured ones carried there by the ring formula
    at4 = [(a * 6 / (2 * (m - 1)), b * (6 / 4) / (2 * (m - 1) / m)) for m, (a, b) in table["all_reduce"].items()]
    lo, hi = sorted(x[0] + x[1] * nbytes for x in at4)
    assert lo <= p.collective_time("all_reduce", nbytes, 4, False) <= hi
    # beyond them: the nearest carried by the ring formula (steps 30 vs 14, share 30/16 vs 14/8)
    a8, b8 = table["all_reduce"][8]
    assert p.collective_time("all_reduce", nbytes, 16, False) == pytest.approx(
        a8 * 30 / 14 + b8 * (30 / 16) / (14 / 8) * nbytes)
    # across nodes the link formula holds; unmeasured kinds use the link inside a node too
    assert p.collective_time("all_reduce", nbytes, 8, True) == \
        hand_profile().collective_time("all_reduce", nbytes, 8, True)
    assert p.collective_time("all_gather", nbytes, 8, False) == \
        hand_profile().collective_time("all_gather", nbytes, 8, False)


def test_roofline_dtype_keys_and_share():
    p = hand_profile(compute_share={1: 1.0, 2: 1.0, 4: 0.5})
    assert p.compute_time(2e12, 1e9, "fp32", ops=3) == pytest.approx(2.0 + 3 * 5e-6)  # compute-bound
    assert p.compute_time(1e9, 5e12, "bf16") == pytest.approx(5.0)  # memory-bound
    for spelled in ("bf16", "bfloat16", torch.bfloat16):
        assert p.matmul_flops(spelled) == 4e12
    assert p.matmul_flops("fp16") == p.matmul_flops("float32") == 1e12  # unknown dtype: fp32's rate
    assert p.share(1) == p.share(2) == 1.0
    assert p.share(3) == pytest.approx(2 / 3)  # 2 ranks' throughput over 3
    assert p.share(8) == pytest.approx(0.5 * 4 / 8)
    assert hand_profile().share(16) == 1.0
    with pytest.warns(DeprecationWarning, match="device_model"):  # one device type: the profile itself
        assert p.device_model("bf16") is p


def test_published_profiles_are_sustained_fractions_of_their_peaks():
    for name in ("h100-80gb", "h200-141gb", "a100-80gb"):
        p = PROFILES[name]
        assert p.flops.keys() == p.peak_flops.keys() and p.ranks_per_node == 8
        for key, rate in p.flops.items():
            assert 0.5 * p.peak_flops[key] < rate < p.peak_flops[key]
        assert p.inter.bandwidth < p.intra.bandwidth and p.inter.latency >= p.intra.latency
        assert p.peak("bfloat16") == p.peak_flops["bf16"]
    h100, h200, a100 = PROFILES["h100-80gb"], PROFILES["h200-141gb"], PROFILES["a100-80gb"]
    assert h200.flops == h100.flops and h200.mem_bw > h100.mem_bw and h200.memory > h100.memory
    assert a100.flops["bf16"] < h100.flops["bf16"] and a100.inter.bandwidth < h100.inter.bandwidth
    assert 70 * 2**30 < h100.memory < 80 * 2**30


def test_json_round_trip(tmp_path):
    p = hand_profile(compute_share={1: 1.0, 2: 0.6}, collectives={"all_reduce": {2: (1e-4, 2e-9)}},
                     peak_flops={"bf16": 9e12}, source="test")
    path = p.save(tmp_path / "sub" / "p.json", extra={"measurements": {"x": 1}})
    assert json.loads(path.read_text())["measurements"] == {"x": 1}
    back = load_profile(str(path))
    assert back == p and \
        back.collective_time("all_reduce", MB, 2, False) == p.collective_time("all_reduce", MB, 2, False)
    assert DeviceProfile.from_dict(p.to_dict()) == p
    for name, prof in PROFILES.items():
        assert DeviceProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof, name


def test_load_profile_names_env_default_and_errors(tmp_path, monkeypatch):
    assert load_profile("H100") is PROFILES["h100-80gb"] and load_profile("a100-80gb") is PROFILES["a100-80gb"]
    p = hand_profile()
    assert load_profile(p) is p
    with pytest.raises(PlanError) as e:
        load_profile("b200")
    assert "h100-80gb" in str(e.value) and "fxpar calibrate" in str(e.value) and "b200" in str(e.value)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="bad.json"):
        load_profile(str(bad))
    (tmp_path / "partial.json").write_text(json.dumps({"name": "x"}))
    with pytest.raises(PlanError, match="flops"):
        load_profile(str(tmp_path / "partial.json"))
    # None: $FXPAR_PROFILE, else the default path if it exists, else the rough cpu profile
    saved = p.save(tmp_path / "env.json")
    monkeypatch.setenv("FXPAR_PROFILE", str(saved))
    assert load_profile(None) == p and profile_for_device("cpu") == p
    monkeypatch.delenv("FXPAR_PROFILE")
    monkeypatch.setattr(profiles, "DEFAULT_PATH", tmp_path / "none.json")
    assert load_profile(None).name == "cpu"
    dataclasses.replace(p, name="default").save(tmp_path / "none.json")
    assert load_profile(None).name == "default" and profile_for_device(torch.device("meta")).name == "default"


def test_fit_alpha_beta_recovers_a_line():
    alpha, beta = 3e-4, 1 / 2e9
    pts = [(n, alpha + beta * n) for n in (4096, 65536, MB, 16 * MB)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)
    a, b = fit_alpha_beta([(4096, 1e-3), (MB, 1e-4)])  # falling with size: no negative slope
    assert a >= 0 and b >= 0


def test_profile_from_synthetic_measurements():
    line = {2: (2e-4, 1e-9), 4: (9e-4, 2e-9)}
    times = {"all_reduce": {str(n): [[x, a + b * x] for x in (4096, MB, 8 * MB)] for n, (a, b) in line.items()},
             "send": {"2": [[x, 5e-5 + x / 3e9] for x in (4096, MB)]}}
    m = {"host": "h", "date": "d", "device": "cpu", "device_name": "cpu", "cores": 2, "world": 4, "backend": "gloo",
         "quick": False, "device_memory": None, "matmul": {"fp32": {"flops": 1e11, "by_size": {}}},
         "memory_bandwidth": {"bytes_per_s": 2e10, "by_size": {}}, "op_overhead": {"forward": 4e-6, "backward": 5e-6},
         "compute_share": {"1": 1.0, "2": 0.9, "4": 0.5}, "times": times}
    p = profile_from_measurements(m)
    assert p.flops == {"fp32": 1e11} and p.mem_bw == 2e10 and p.op_overhead == 4e-6 and p.ranks_per_node == 4
    assert p.compute_share == {1: 1.0, 2: 0.9, 4: 0.5}
    for n, (a, b) in line.items():
        got = p.collectives["all_reduce"][n]
        assert got[0] == pytest.approx(a, rel=1e-6) and got[1] == pytest.approx(b, rel=1e-6)
    # the links come from the largest group's all-reduce: 6 steps, 3/2 of the bytes per rank
    assert p.intra.latency == pytest.approx(9e-4 / 6) and p.intra.bandwidth == pytest.approx(1.5 / 2e-9)
    assert p.collective_time("send", 8 * MB, 2, False) == pytest.approx(5e-5 + 8 * MB / 3e9)
    assert "calibrated on h" in p.source


def test_elementwise_first_touch_and_optimizer_terms():
    """A node that is not a matrix product goes at the elementwise rate (or memory, whichever is slower); an
    output at or above the fresh-mapping threshold pays its first touch; the optimizer's measured time per
    entry wins over the memory-bound estimate. A profile without these terms prices as before."""
    p = hand_profile(elementwise_rate=2e9, fresh_bw=4e9, fresh_threshold=32 * MB, optimizer_entry_time=3e-9)
    assert p.compute_time(4e9, 1e9, "fp32", matmul=False) == pytest.approx(max(4e9 / 2e9, 1e9 / 1e12))
    assert p.compute_time(4e9, 1e9, "fp32") == pytest.approx(max(4e9 / 1e12, 1e9 / 1e12))
    assert p.fresh_time(32 * MB - 1) == 0.0 and p.fresh_time(64 * MB) == pytest.approx(64 * MB / 4e9)
    assert p.optimizer_time(1e6) == pytest.approx(3e-3)
    plain = hand_profile()
    assert plain.compute_time(4e9, 1e9, "fp32", matmul=False) == pytest.approx(1e9 / 1e12)
    assert plain.fresh_time(64 * MB) == 0.0 and plain.optimizer_time(1e6) == pytest.approx(28e6 / 1e12)
    assert DeviceProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
