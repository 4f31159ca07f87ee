"""HSDP (``Plan(dp_replicate=R)``) in the planner, on hand-built ModelCosts: memory sharded over dp / R, the
data-parallel bytes of each group against the ring formulas (the shard group's inside a node, only the
replicas' all-reduce of a shard across nodes), and the search choosing HSDP where the nodes' link is slow."""

import pytest

from fxpar.cost.profiles import DeviceProfile, Link
from fxpar.ir.plan import Plan
from fxpar.planner.dp_groups import replica_options
from fxpar.planner.model_costs import ModelCosts, RankPart
from fxpar.planner.price import price_plan
from fxpar.planner.search import search
from fxpar.planner.space import candidates


def profile(rpn=8, inter=4e10):
    return DeviceProfile("test", flops={"bf16": 4e14, "fp32": 5e13}, mem_bw=2e12, memory=80 * 10**9,
                         ranks_per_node=rpn, intra=Link(3e11, 5e-6), inter=Link(inter, 2e-5),
                         peak_flops={"bf16": 1e15})


def costs(layers=8, h=1024, seq=512):
    """A small Llama-shaped model without TP: per layer 7 matmuls, attention and 6 cheap ops."""
    mats = [(h, h)] * 4 + [(h, 4 * h)] * 2 + [(4 * h, h)]
    nodes = [(2 * seq * a * o, 4 * seq * a * o, 2 * seq * (a + o), 2 * a * o) for a, o in mats]
    nodes.append((2 * seq * seq * h, 5 * seq * seq * h, 8 * seq * h, 0))
    nodes += [(4 * seq * h, 4 * seq * h, 6 * seq * h, 0)] * 6
    kept = 2 * seq * h * 18
    act = {"none": (kept, 0), "selective": (kept // 2, kept // 2), "layer": (2 * seq * h, kept)}
    edge = [(2 * seq * h * 1000, 4 * seq * h * 1000, 2 * seq * h, 2000 * h)]
    none = {k: (0, 0) for k in act}
    parts = {"layer": {(1, False): RankPart(nodes, sum(a * o for a, o in mats) + 2 * h, [], act, 2 * seq * h)},
             "pre": {(1, False): RankPart(edge, 1000 * h, [], none, 2 * seq * h)},
             "post": {(1, False): RankPart(edge, 1000 * h, [], none, 0)}}
    n = layers * parts["layer"][(1, False)].params + 2000 * h
    return ModelCosts(seq, "bf16", ["layer"] * layers, parts, n, {1: None}, 6.0 * n, 2)


def ring(share, k, nbytes):
    return share * (k - 1) / k * nbytes


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hsdp_shards_over_dp_over_r_and_sends_only_a_shard_across_nodes(zero):
    c, p = costs(), profile(rpn=4, inter=1e9)  # 8 ranks on 2 nodes; the flat dp group spans both
    flat = price_plan(c, Plan(dp=8, zero=zero), p, global_batch=8)
    hsdp = price_plan(c, Plan(dp=8, zero=zero, dp_replicate=2), p, global_batch=8)  # shard groups of 4: a node
    n = c.params
    sharded = ["optimizer"] + (["grads"] if zero >= 2 else []) + (["params"] if zero == 3 else [])
    for kind in sharded:  # each sharded state twice the flat plan's: over 4 ranks, not 8
        assert hsdp.memory[kind] == pytest.approx(2 * flat.memory[kind], rel=1e-6), (kind, hsdp.memory, flat.memory)
    assert hsdp.memory["optimizer"] == 2 * 4 * n // 4  # AdamW's two fp32 states over dp / R = 4 ranks
    full, part = 4 * n, 4 * -(-n // 4)
    across = ring(2, 2, part)  # the replicas' all-reduce of this rank's shard of the gradients
    if zero == 3:  # per step (one microbatch): gathers forward and backward, a reduce-scatter, over 4 and 8
        inside, flat_dp = ring(2, 4, 4 * n) + ring(1, 4, full), ring(2, 8, 4 * n) + ring(1, 8, full)
    else:  # a reduce-scatter, (ZeRO-1) the reduced gradients gathered back, the updated shards gathered
        inside, flat_dp = ring(1, 4, full) * (3 if zero == 1 else 2), ring(2, 8, full) + ring(1, 8, full)
    assert hsdp.comm_bytes["dp"] == int(inside + across) and flat.comm_bytes["dp"] == int(flat_dp)
    assert hsdp.comm_bytes["dp_inter"] == int(across) and flat.comm_bytes["dp_inter"] == int(flat_dp)
    assert hsdp.comm_bytes["dp_inter"] * 4 < flat.comm_bytes["dp_inter"]  # a quarter of the gradients, once
    assert hsdp.parts["dp_comm"] < flat.parts["dp_comm"]  # the slow link carries less
    assert hsdp.parts["compute"] == pytest.approx(flat.parts["compute"])


def test_inside_one_node_hsdp_only_costs_memory():
    c, p = costs(), profile(rpn=8)
    flat = price_plan(c, Plan(dp=8, zero=3), p, global_batch=8)
    hsdp = price_plan(c, Plan(dp=8, zero=3, dp_replicate=2), p, global_batch=8)
    assert hsdp.comm_bytes["dp_inter"] == flat.comm_bytes["dp_inter"] == 0
    assert hsdp.memory["total"] > flat.memory["total"]
    assert replica_options(8, 1, 8) == [1]  # so the search does not price it


def test_the_search_chooses_hsdp_where_the_nodes_link_is_slow():
    c = costs()
    slow = search(c, 16, profile(rpn=8, inter=1.25e10), global_batch=64)  # 2 nodes of 8 on 100 Gb/s
    assert slow.best.dp_replicate > 1 and slow.best.zero >= 1, slow.to_text()
    shard_ranks = slow.best.dp // slow.best.dp_replicate * slow.best.pp * slow.best.tp
    assert shard_ranks <= 8  # the shard groups inside a node
    flat = min((e for e in slow.ranked if e.plan.dp_replicate == 1), key=lambda e: e.step_time)
    assert flat.step_time > 1.2 * slow.estimate.step_time, (flat.plan, slow.best)
    assert "dp_replicate=" in slow.to_text()
    fast = search(c, 16, profile(rpn=8, inter=3e11), global_batch=64)  # nodes linked as fast as inside one
    assert fast.estimate.step_time <= slow.estimate.step_time
    # the space: HSDP only with ZeRO, only where the dp group spans nodes, its shard groups a node each
    plans, _ = candidates(c, 16, 16, ranks_per_node=8)
    hsdp = [p for p in plans if p.dp_replicate > 1]
    assert hsdp and all(p.zero >= 1 and p.dp // p.dp_replicate * p.pp * p.tp == 8 for p in hsdp)
    assert {(p.dp, p.pp, p.dp_replicate) for p in hsdp} == {(16, 1, 2), (8, 2, 2), (4, 4, 2)}  # dp=2 x pp=8: none
