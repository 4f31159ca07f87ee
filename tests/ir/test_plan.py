"""Plan: construction, parsing from a string and from JSON/TOML files, and its errors."""

from __future__ import annotations

import json

import pytest

from fxpar import Plan, PlanError


def test_parse_and_world_size():
    p = Plan.parse("dp=2, pp=2,tp=2,zero=1,microbatches=4,schedule=interleaved_1f1b")
    assert (p.dp, p.pp, p.tp, p.zero, p.microbatches, p.schedule) == (2, 2, 2, 1, 4, "interleaved_1f1b")
    assert p.world_size == 8
    assert Plan.parse("") == Plan()


def test_from_files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"pp": 4, "split_points": {"model.layers.2": "beginning"}}))
    assert Plan.from_file(tmp_path / "p.json").split_points == {"model.layers.2": "beginning"}
    (tmp_path / "p.toml").write_text('[plan]\npp = 2\nschedule = "zbv"\nmicrobatches = 8\n')
    assert Plan.from_file(tmp_path / "p.toml") == Plan(pp=2, schedule="zbv", microbatches=8)


@pytest.mark.parametrize("text,match", [
    ("pp=0", "Plan.pp=0"),
    ("zero=4", "zero takes one of 0, 1, 2, 3"),
    ("pp=two", "pp takes an integer"),
    ("ppp=2", "cannot read 'ppp=2'"),
    ("microbatches=0", "microbatches"),
])
def test_bad_plans(text, match):
    with pytest.raises(PlanError, match=match):
        Plan.parse(text)


def test_bad_split_point_and_file(tmp_path):
    with pytest.raises(PlanError, match="beginning"):
        Plan(pp=2, split_points={"model.layers.1": "middle"})
    (tmp_path / "p.pkl").write_text("")
    with pytest.raises(PlanError, match="json or .toml"):
        Plan.from_file(tmp_path / "p.pkl")
    (tmp_path / "q.json").write_text('{"pipeline": 2}')
    with pytest.raises(PlanError, match="unknown key .pipeline."):
        Plan.from_file(tmp_path / "q.json")


def test_hsdp_plans_parse_and_bad_ones_name_the_fix():
    plan = Plan.parse("dp=4,dp_replicate=2,zero=3")
    assert (plan.dp, plan.dp_replicate, plan.dp_shard, plan.world_size, plan.replicas) == (4, 2, 2, 4, 4)
    for text, match in [("dp=4,dp_replicate=3,zero=3", r"dp_replicate=3\): .* use dp_replicate in \[2, 4\]"),
                        ("dp=4,dp_replicate=2", r"zero=0\): without ZeRO every dp rank is a replica already"),
                        ("dp=2,dp_replicate=2,ep=2,zero=1", "HSDP does not compose with expert parallelism"),
                        ("dp=2,dp_replicate=0,zero=1", "Plan.dp_replicate=0")]:
        with pytest.raises(PlanError, match=match):
            Plan.parse(text)
