"""compile's wiring on one process: programs cached per input signature *and* shapes, and plans priced
without any process group (what ``fxpar plan`` and a planner do)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fxpar
from fxpar import zoo
from fxpar.api import price


def sgd(params):
    return torch.optim.SGD(params, lr=1e-2)


def test_a_new_sequence_length_compiles_again_and_matches_eager():
    cfg = zoo.tiny_config("llama")
    short = zoo.example_inputs("llama", cfg, batch=4, seq=16)
    long = zoo.example_inputs("llama", cfg, batch=4, seq=32)
    compiled = fxpar.compile(zoo.build("llama", seed=0), fxpar.Plan(), example_kwargs=short, optimizer=sgd)
    reference = zoo.build("llama", seed=0)
    opt = sgd(reference.parameters())
    for batch in (short, long, short):
        loss = compiled.step(**batch)
        opt.zero_grad()
        ref = reference(**batch).loss
        ref.backward()
        opt.step()
        assert abs(loss.item() - ref.item()) <= 1e-5, (loss.item(), ref.item())


def test_price_builds_rank_0_of_a_plan_without_any_process_group():
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=8, seq=16)
    priced = price(zoo.build("llama", seed=0), "dp=2,pp=2,tp=2,zero=1", example_kwargs=batch,
                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert not dist.is_initialized()
    assert len(priced.pipeline.stages) == 2 and priced.tp_info.sharded
    assert priced.spec.group_name("tp") == "tp:0,1"
    text = fxpar.inspect(priced, quiet=True).to_text()
    assert "data parallel: dp=2, ZeRO-1" in text and "memory per rank, predicted" in text


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_plan_command_dumps_every_pass_that_ran(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPAR_DUMP_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "fxpar", "plan", "llama", "--plan", "dp=2,pp=2,tp=2,zero=3"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    ran = ["tensor_parallel", "pipeline_split", "param_updates", "zero3"]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("passes:"))
    assert [w.split()[0] for w in line[len("passes:"):].split(",")] == ran, line
    for i, name in enumerate(ran, 1):
        stage = ".stage0" if name in ("param_updates", "zero3") else ""
        for when in ("before", "after"):
            assert (tmp_path / f"{i:02d}-{name}{stage}.{when}.txt").stat().st_size > 0
    assert "fxpar.all_reduce" in (tmp_path / "01-tensor_parallel.after.txt").read_text()
    assert "fxpar.all_reduce" not in (tmp_path / "01-tensor_parallel.before.txt").read_text()


def test_inductor_is_the_last_pass_of_the_list_and_the_runtime_runs_what_it_made(tmp_path, monkeypatch):
    """Plan(compile=True): the pass runner runs (times, dumps) Inductor as the pass list's last entry; the
    runtime calls the stage callables that pass made, and compiles nothing itself. Nothing runs: cheap."""
    monkeypatch.setenv("FXPAR_DUMP_DIR", str(tmp_path))  # fxpar.ir.options reads it per distinct environment
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    compiled = fxpar.compile(zoo.build("llama", seed=0), "compile=1", example_kwargs=batch, optimizer=sgd)
    ran = [name for name, _ in compiled.result.timings]
    assert ran == ["pipeline_split", "drop_dtype_asserts", "inductor"], ran
    assert sorted(compiled.result.stage_fns) == [0]
    dumps = sorted(p.name for p in tmp_path.iterdir() if "inductor" in p.name)
    assert dumps == ["03-inductor.stage0.after.txt", "03-inductor.stage0.before.txt"], dumps
    runtime = compiled.programs.get((), batch)[1]
    assert runtime.stage_fns[0] is compiled.result.stage_fns[0]


def test_a_meta_model_is_priced_under_zero3_without_its_weights():
    # fxpar plan MODEL_DIR --plan dp=2,zero=3 builds the model on the meta device and has no weights to read:
    # the shards are shapes only, and the plan prices as the materialised model's does
    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=8, seq=16)
    got = {}
    for device in ("meta", "cpu"):
        priced = price(zoo.build("llama", seed=0, device=device), "dp=2,zero=3", example_kwargs=batch,
                       optimizer=sgd)
        buckets = priced.result.zero3_buckets[0]
        assert buckets and all(b.shard.is_meta == (device == "meta") for b in buckets)
        got[device] = (priced.memory()["predicted"], [b.shard.numel() for b in buckets])
    assert got["meta"] == got["cpu"]


def test_price_returns_a_priced_plan_with_nothing_to_run():
    """fxpar.api.price builds the plan's rank without a runtime: a PricedPlan (the reading half of a compiled
    model, its Estimate as ``predicted``), not a CompiledModel whose ``step`` could only raise."""
    from fxpar.runtime.model import PricedPlan

    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=4, seq=8)
    priced = price(zoo.build("llama", seed=0), "dp=2", example_kwargs=batch, optimizer=sgd)
    assert isinstance(priced, PricedPlan) and not isinstance(priced, fxpar.CompiledModel)
    assert not hasattr(priced, "step") and not callable(priced) and priced.programs.get((), batch)[1] is None
    assert priced.memory()["predicted"] and "measured" not in priced.memory()
