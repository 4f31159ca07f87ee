"""MeshSpec: rank <-> coordinates and group names, TP innermost, for any world, with no process group."""

from __future__ import annotations

import pytest

from fxpar.ir.mesh import MeshSpec


def test_coordinates_round_trip_tp_innermost():
    m = MeshSpec(dp=2, pp=3, tp=4)
    seen = set()
    for r in range(m.world_size):
        c = m.coords(r)
        assert m.rank_of(**c) == r
        seen.add((c["dp"], c["pp"], c["tp"]))
    assert len(seen) == 24
    assert m.coords(5) == {"dp": 0, "pp": 1, "tp": 1}  # rank = (dp * pp + pp_rank) * tp + tp_rank


def test_group_names_list_the_ranks_and_partition_the_world():
    m = MeshSpec(dp=2, pp=2, tp=2, rank=5)
    assert (m.group_name("tp"), m.group_name("pp"), m.group_name("dp")) == ("tp:4,5", "pp:5,7", "dp:1,5")
    assert m.pipeline_ranks() == [5, 7]
    for axis in ("dp", "pp", "tp"):
        groups = m.axis_groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert all(len(g) == m.size(axis) for g in groups)


def test_two_plans_on_one_world_have_different_group_names():
    # tp=4 and dp=2 x tp=2 on four ranks: rank 0's TP groups differ, so their names differ
    assert MeshSpec(tp=4).group_name("tp") == "tp:0,1,2,3"
    assert MeshSpec(dp=2, tp=2).group_name("tp") == "tp:0,1"


def test_bad_mesh_is_refused():
    with pytest.raises(ValueError, match="rank=8"):
        MeshSpec(dp=2, tp=4, rank=8)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        MeshSpec().group_name("sp")


def test_hsdp_splits_dp_into_replicas_of_neighbouring_shard_groups():
    m = MeshSpec(dp=4, tp=2, dp_replicate=2)  # dp rank = replicate rank * 2 + shard rank
    shards = {tuple(m.shard_ranks(r)) for r in range(8)}
    copies = {tuple(m.replicate_ranks(r)) for r in range(8)}
    assert shards == {(0, 2), (1, 3), (4, 6), (5, 7)} and copies == {(0, 4), (1, 5), (2, 6), (3, 7)}
    r6 = m.with_rank(6)
    assert (r6.dp_rank, r6.dp_replicate_rank, r6.dp_shard_rank, r6.dp_shard) == (3, 1, 1, 2)
    assert (r6.shard_group_name(), r6.replicate_group_name()) == ("dp_shard:4,6", "dp_replicate:2,6")
    flat = MeshSpec(dp=4, tp=2, rank=6)  # without HSDP ZeRO shards over the dp group, under its name
    assert flat.shard_group_name() == flat.group_name("dp") == "dp:0,2,4,6" and flat.dp_shard_rank == 3
    with pytest.raises(ValueError, match="dp_replicate=3"):
        MeshSpec(dp=4, dp_replicate=3)
    # with cp, a shard group is the replica's dp / dp_replicate ranks x every cp rank; copies keep the cp rank
    c = MeshSpec(dp=4, cp=2, tp=2, dp_replicate=2, rank=13)  # dp rank 3 (replica 1, shard 1), cp rank 0, tp 1
    assert (c.dp_replicate_rank, c.dp_shard_rank, c.dp_shard) == (1, 2, 4)
    assert c.shard_group_name() == "dp_shard:9,11,13,15" and c.replicate_group_name() == "dp_replicate:5,13"
    # with ep, an expert slice's gradients reduce over the dp x cp ranks of its ep rank, dense ones over dp x ep x cp
    e = MeshSpec(dp=2, ep=2, cp=2, rank=5)  # dp 1, ep 0, cp 1
    assert e.grad_group_name(experts=True) == "dpcp:0,1,4,5" and e.grad_group_name() == "dpcp:0,1,2,3,4,5,6,7"
