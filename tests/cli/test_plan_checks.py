"""``fxpar plan`` and the plan checks ``fxpar train`` shares, on one process without any communication:
strict plan values, the device profile predictions are for (and why), ``plan --auto`` choosing what
``train --plan auto`` chooses and saying why, pipelines with nearly empty stages or a large bubble, the
stage table's pipeline ranks."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

import fxpar
from fxpar.testing.hfdir import make_model_dir


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("deep"), "llama", num_hidden_layers=4)


@pytest.fixture
def cpu_machine(monkeypatch, tmp_path):
    """A machine without a GPU and without a calibrated profile (unless a test writes one)."""
    import fxpar.cost.profiles as profiles

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("FXPAR_PROFILE", raising=False)
    monkeypatch.setattr(profiles, "DEFAULT_PATH", tmp_path / "no-profile.json")
    return tmp_path / "no-profile.json"


def _cli(argv, capsys, status: int = 0) -> tuple[str, str]:
    from fxpar.cli import main

    assert main(argv) == status
    out = capsys.readouterr()
    return out.out, out.err


# ---- 1. plan values, strictly, before anything runs ---------------------------------------------------------
def test_plan_and_train_refuse_a_misspelt_boolean(model_dir, no_communication, capsys, tmp_path):
    from fxpar.cli import train

    _, err = _cli(["plan", str(model_dir), "--plan", "tp=2,sequence_parallel=ture"], capsys, status=2)
    assert "fxpar: plan 'tp=2,sequence_parallel=ture': sequence_parallel='ture': sequence_parallel takes true, " \
           "false, 1 or 0" in err
    (tmp_path / "plan.toml").write_text('[plan]\ntp = 2\nsequence_parallel = "yes please"\n')
    assert train.main([str(model_dir), "--plan-file", str(tmp_path / "plan.toml"), "--data", "synthetic"]) == 2
    assert "sequence_parallel='yes please': sequence_parallel takes true, false, 1 or 0" in capsys.readouterr().err


# ---- 3. the device profile predictions are for ----------------------------------------------------------------
def test_plan_names_the_cpu_profile_on_a_machine_without_a_gpu(model_dir, cpu_machine, no_communication, capsys):
    out, _ = _cli(["plan", str(model_dir), "--plan", "pp=2"], capsys)
    assert "predicted times are for cpu (no GPU on this machine and no calibrated profile: the built-in rough " \
           "CPU profile; `fxpar calibrate` measures this host)" in out
    assert re.search(r"predicted 1f1b step with 2 microbatches on cpu: ", out), out
    assert "H100" not in out


def test_plan_prefers_the_calibrated_profile_and_takes_device(model_dir, cpu_machine, no_communication, capsys):
    from fxpar.cost.profiles import cpu_default

    dataclasses.replace(cpu_default(), name="calibrated-testhost").save(cpu_machine)
    out, _ = _cli(["plan", str(model_dir), "--plan", "pp=2"], capsys)
    assert f"predicted times are for calibrated-testhost (no GPU on this machine: this host's profile from " \
           f"`fxpar calibrate` ({cpu_machine}))" in out
    assert "microbatches on calibrated-testhost: " in out
    out, _ = _cli(["plan", str(model_dir), "--plan", "pp=2", "--device", "h100-80gb"], capsys)
    assert "predicted times are for h100-80gb (asked for)" in out and "microbatches on h100-80gb: " in out


# ---- 4. plan --auto chooses what train --plan auto chooses, and says why ---------------------------------------
def test_plan_auto_and_train_auto_choose_the_same_plan(model_dir, cpu_machine, no_communication, capsys):
    import argparse

    from fxpar.cli import build_parser
    from fxpar.cli.train import add_arguments
    from fxpar.planner.auto import explain, plan_for_compile
    from fxpar.train.models import example_kwargs, load_model

    train_parser = argparse.ArgumentParser()
    add_arguments(train_parser)
    train = train_parser.parse_args([str(model_dir)])
    plan_args = build_parser().parse_args(["plan", str(model_dir), "--auto", "--world", "4"])
    assert (plan_args.batch, plan_args.seq) == (train.batch * train.grad_accum, train.seq)  # the same defaults

    text, _ = _cli(["plan", str(model_dir), "--auto", "--world", "4"], capsys)
    previewed = re.search(r"^plan 'auto': (\S+) for 4 ranks of (\S+) ", text, re.M)
    # as fxpar train --plan auto calls it: the global batch of one step, the ranks' device
    model = load_model(str(model_dir), meta=False)
    batch = example_kwargs(model, train.batch * train.grad_accum, train.seq)
    chosen = plan_for_compile(model, (), batch, world=4, device=torch.device("cpu"),
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=train.lr), frontend="auto")
    assert fxpar.Plan.parse(previewed.group(1)) == chosen.best
    assert previewed.group(2) == chosen.profile.name == "cpu"

    why = explain(chosen)  # what both print: the same words for the same choice
    assert why in text
    assert why.startswith(f"plan 'auto': {chosen.best.to_text()} for 4 ranks of cpu (no GPU on this "
                          "machine and no calibrated profile")
    assert re.search(r"why: the fastest of \d+ plans that fit: predicted [0-9.]+ ms/step, [0-9.]+ MiB per rank", why)
    assert "runner-up" in why and "hand-made baseline" in why and "the others: " in why


# ---- 2. pipelines with nearly empty stages or a large bubble ------------------------------------------------
def _number(text: str) -> float:
    """'16.4K' -> 16400.0, '3.3M' -> 3.3e6 (the tables' human numbers)."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def test_stages_nearly_empty_warn_with_the_numbers_and_a_better_plan(deep_dir, cpu_machine, no_communication,
                                                                     capsys, caplog):
    out, _ = _cli(["plan", str(deep_dir), "--plan", "pp=16", "--batch", "16"], capsys)
    warning = caplog.text
    head = re.search(r"pipeline pp=16 \(16 stages, 1f1b, 16 microbatches\) on LlamaForCausalLM with 4 decoder "
                     r"layers: (\d+) of 16 stages are nearly empty \(under 10% of the busiest stage's FLOPs: "
                     r"stages ([\d, ]+)\) and the schedule idles ([\d.]+)% of the step", warning)
    assert head, warning
    rows = re.findall(r"^ +(\d+) +(\d+)(?: \(\+(\d+) cut\))? +(\S+) +(\S+)  (\S.*)$", warning, re.M)
    assert [int(r[0]) for r in rows] == list(range(16)), warning
    # the table's numbers add up to the model's own totals, which the report prints from the trace
    params = re.search(r"traced with frontend=\S+: \d+ ops, (\S+) params, forward (\S+)FLOPs, backward (\S+)FLOPs", out)
    assert abs(sum(_number(r[3]) for r in rows) / _number(params.group(1)) - 1) < 0.02
    total = _number(params.group(2)) + _number(params.group(3))
    assert abs(sum(_number(r[4]) for r in rows) / total - 1) < 0.02
    empty = [int(i) for i in head.group(2).split(", ")]
    busiest = max(_number(r[4]) for r in rows)
    assert len(empty) == int(head.group(1)) >= 4 and all(_number(rows[i][4]) < 0.1 * busiest for i in empty)
    assert float(head.group(3)) > 50
    assert "better: use pp=4 (each of its 4 stages at least one of the 4 decoder layers), e.g. --plan dp=4,pp=4 " \
           "on the same 16 ranks" in warning


def test_a_large_bubble_warns_and_names_a_microbatch_count(deep_dir, cpu_machine, no_communication, capsys, caplog):
    _cli(["plan", str(deep_dir), "--plan", "pp=4,microbatches=1", "--batch", "16"], capsys)
    # one microbatch runs the stages one after another: each rank idles 3/4 of the step
    assert "pipeline pp=4 (4 stages, 1f1b, 1 microbatch) on LlamaForCausalLM with 4 decoder layers: the schedule " \
           "idles 75.0% of the step" in caplog.text
    assert "nearly empty" not in caplog.text
    assert re.search(r"better: use more microbatches: microbatches=16 idles \d+\.\d% of the step$", caplog.text, re.M)


def test_more_stages_than_cut_points_is_an_error_naming_the_numbers(deep_dir, no_communication, capsys):
    _, err = _cli(["plan", str(deep_dir), "--plan", "pp=32", "--batch", "32"], capsys, status=2)
    assert "32 pipeline stages need 31 cuts, but LlamaForCausalLM offers only 18 cut points" in err
    assert "at most 19 stages (pp x virtual_stages); with its 4 decoder layers, 4 stages give each one layer" in err


# ---- 5. the stage table's pipeline ranks --------------------------------------------------------------------
def test_stage_table_names_pp_ranks_and_their_global_ranks(deep_dir, cpu_machine, no_communication, capsys, caplog):
    from fxpar.ir.mesh import MeshSpec

    out, _ = _cli(["plan", str(deep_dir), "--plan", "dp=2,pp=2,tp=2"], capsys)
    assert "pipeline pp=2" not in caplog.text  # two stages of two layers each: nothing to warn about
    assert re.search(r"^stage +pp rank +ranks +modules +params", out, re.M), out
    rows = re.findall(r"^ +(\d) +(\d) +(\S+) +(?:\(start\)|model)", out, re.M)
    assert [(s, p) for s, p, _ in rows] == [("0", "0"), ("1", "1")]
    mesh = MeshSpec(dp=2, pp=2, tp=2)
    for _, pp_rank, ranks in rows:  # every global rank whose pp coordinate is the stage's pipeline rank
        assert ranks == {"0": "0-1,4-5", "1": "2-3,6-7"}[pp_rank]
        assert sorted(r for r in range(8) if mesh.coords(r)["pp"] == int(pp_rank)) == \
            [r for part in ranks.split(",") for r in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    assert re.search(r"^stage +pp rank +fwd FLOPs +bwd FLOPs", out, re.M)
    data = json.loads(_cli(["plan", str(deep_dir), "--plan", "dp=2,pp=2,tp=2", "--json"], capsys)[0])
    assert [(s["pp_rank"], s["ranks"]) for s in data["stages"]] == [(0, [0, 1, 4, 5]), (1, [2, 3, 6, 7])]
