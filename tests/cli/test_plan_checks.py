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
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model"), "llama")


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("deep"), "llama", num_hidden_layers=4)


@pytest.fixture
def no_communication(monkeypatch):
    """Any way of joining a process group fails the test."""
    import torch.distributed as dist

    import fxpar.launch

    def trap(*a, **k):
        raise AssertionError("a process group was being joined: the check came after communication could start")

    monkeypatch.setattr(fxpar.launch, "init_distributed", trap)
    monkeypatch.setattr(dist, "init_process_group", trap)


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

    from fxpar.auto import explain, plan_for_compile
    from fxpar.cli import build_parser
    from fxpar.cli.train import add_arguments
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
    assert why.startswith(f"plan 'auto': {fxpar.auto.plan_text(chosen.best)} for 4 ranks of cpu (no GPU on this "
                          "machine and no calibrated profile")
    assert re.search(r"why: the fastest of \d+ plans that fit: predicted [0-9.]+ ms/step, [0-9.]+ MiB per rank", why)
    assert "runner-up" in why and "hand-made baseline" in why and "the others: " in why

