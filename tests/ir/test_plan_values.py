"""Plan values are read by their fields' types, in ``Plan.parse`` strings and ``Plan.from_file`` JSON / TOML
alike: every boolean field takes true/false/1/0 (any case) or a file's boolean, integers must be integers,
choices are checked, an unknown key names the nearest valid one. Each error names the key, the value and
what the field accepts."""

from __future__ import annotations

import json
import typing
from dataclasses import fields

import pytest

from fxpar import Plan, PlanError
from fxpar.ir.plan import field_value

HINTS = typing.get_type_hints(Plan)
BOOLS = [f.name for f in fields(Plan) if HINTS[f.name] in (bool, bool | None)]
INTS = [f.name for f in fields(Plan) if HINTS[f.name] in (int, int | None)]


def test_the_rule_covers_every_boolean_and_integer_field():
    assert {"sequence_parallel", "offload", "quantize_grads", "fused_loss", "compile"} <= set(BOOLS)
    assert {"dp", "pp", "tp", "ep", "microbatches", "virtual_stages", "prefetch", "collective_matmul"} <= set(INTS)


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("text,expected", [("true", True), ("TRUE", True), ("1", True), ("False", False),
                                           ("0", False)])
def test_booleans_take_true_false_1_0(name, text, expected):
    assert field_value(name, text) is expected
    assert field_value(name, expected) is expected and field_value(name, int(expected)) is expected  # a file's


@pytest.mark.parametrize("name", BOOLS)
@pytest.mark.parametrize("bad", ["ture", "yes", "on", "yes please", "2"])
def test_every_boolean_refuses_anything_else(name, bad):
    with pytest.raises(PlanError, match=rf"{name}='{bad}': {name} takes true, false, 1 or 0"):
        Plan.parse(f"{name}={bad}")
    with pytest.raises(PlanError, match=rf"{name}='{bad}': {name} takes true, false, 1 or 0"):
        Plan(**{name: bad})  # a Python caller's string is no boolean either


@pytest.mark.parametrize("name", INTS)
@pytest.mark.parametrize("bad", ["two", "2.0", "2.5", "true"])
def test_integers_must_be_integers(name, bad):
    with pytest.raises(PlanError, match=rf"{name}='{bad}': {name} takes an integer"):
        Plan.parse(f"{name}={bad}")


@pytest.mark.parametrize("text,match", [
    ("tp=2,sequence_parallel=ture", r"plan 'tp=2,sequence_parallel=ture': sequence_parallel='ture': "
                                    r"sequence_parallel takes true, false, 1 or 0"),
    ("zero=4", r"zero=4: zero takes one of 0, 1, 2, 3"),
    ("zero=true", r"zero='true': zero takes one of 0, 1, 2, 3"),
    ("mixed_precision=fp8", r"mixed_precision='fp8': mixed_precision takes one of bf16 or none"),
    ("recompute=all", r"recompute='all': recompute takes one of none, layer, selective"),
    ("comm_dtype=int4", r"comm_dtype='int4': comm_dtype takes one of int8 or none"),
    ("bucket_mb=big", r"bucket_mb='big': bucket_mb takes a number"),
    ("schedule=gpipee", r"Plan.schedule='gpipee': unknown pipeline schedule 'gpipee'; use one of gpipe, 1f1b"),
    ("tp=2,sequence_paralel=true", r"unknown key 'sequence_paralel'; did you mean 'sequence_parallel'\?"),
    ("tp=2,micro_batches=4", r"unknown key 'micro_batches'; did you mean 'microbatches'\?"),
    ("tp=2,tp=4", r"tp is given twice"),
    ("tp_plan=auto", r"tp_plan is a table of strings; it goes in a plan file"),
    ("tp2", r"cannot read 'tp2'; write key=value pairs"),
    ("auto", r"'auto' is chosen by the planner, not parsed: fxpar plan --auto"),
])
def test_bad_values_name_the_key_the_value_and_what_is_accepted(text, match):
    with pytest.raises(PlanError, match=match):
        Plan.parse(text)


def test_good_values_read_by_type():
    plan = Plan.parse("tp=2,sequence_parallel=TRUE,zero=1,dp=2,mixed_precision=BF16,recompute=Layer,"
                      "bucket_mb=4,compile=auto,microbatches=none,tp_replicate=model.embed_tokens+lm_head")
    assert (plan.sequence_parallel, plan.zero, plan.mixed_precision, plan.recompute, plan.bucket_mb, plan.compile,
            plan.microbatches, plan.tp_replicate) == (True, 1, "bf16", "layer", 4.0, None, None,
                                                      ("model.embed_tokens", "lm_head"))


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_files_follow_the_same_rule(tmp_path, suffix):
    def write(**values) -> str:
        path = tmp_path / f"plan{suffix}"
        if suffix == ".json":
            path.write_text(json.dumps(values))
        else:
            path.write_text("[plan]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
        return path

    assert Plan.from_file(write(tp=2, sequence_parallel=True)).sequence_parallel is True
    assert Plan.from_file(write(tp=2, sequence_parallel="false", fused_loss=1)) == Plan(tp=2, fused_loss=True)
    assert Plan.from_file(write(tp=2, tp_replicate=["lm_head"])).tp_replicate == ("lm_head",)
    for values, match in [({"sequence_parallel": "yes please"},
                           r"plan file .*plan\.(toml|json): sequence_parallel='yes please': sequence_parallel takes "
                           "true, false, 1 or 0"),
                          ({"offload": 2}, r"offload=2: offload takes true, false, 1 or 0"),
                          ({"dp": 2.5}, r"dp=2.5: dp takes an integer"),
                          ({"dp": True}, r"dp=True: dp takes an integer"),
                          ({"zero": "3b"}, r"zero='3b': zero takes one of 0, 1, 2, 3"),
                          ({"recompute": "everything"}, r"recompute='everything': recompute takes one of none"),
                          ({"schedul": "gpipe"}, r"unknown key 'schedul'; did you mean 'schedule'\?"),
                          ({"sequence_paralel": True}, r"did you mean 'sequence_parallel'\?")]:
        with pytest.raises(PlanError, match=match):
            Plan.from_file(write(**values))


def test_a_file_that_is_not_a_table(tmp_path):
    (tmp_path / "p.json").write_text("[2, 2]")
    with pytest.raises(PlanError, match=r"p\.json: holds a list; write a table of Plan fields"):
        Plan.from_file(tmp_path / "p.json")
    (tmp_path / "p.toml").write_text("tp = \n")
    with pytest.raises(PlanError, match=r"p\.toml: not valid TOML"):
        Plan.from_file(tmp_path / "p.toml")
    (tmp_path / "t.json").write_text(json.dumps({"tp": 2, "tp_plan": ["colwise"]}))
    with pytest.raises(PlanError, match=r"tp_plan=\['colwise'\]: use 'auto' or a table"):
        Plan.from_file(tmp_path / "t.json")
