"""``fxpar inspect`` on the command line: table, graph, JSON and the FLOP count against the analytic one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fxpar import zoo
from fxpar.cli import main
from fxpar.testing import multiproc
from fxpar.testing.cli import fxpar_on_rank

pool2 = multiproc.rank_pool(2)


def analytic_flops(cfg, batch: int, seq: int) -> int:
    """2 * (params of the linear layers) * tokens + attention scores and values (4 * b * s^2 * h per layer)."""
    h, inter, vocab, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    head_dim = h // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + h * vocab
    return 2 * linear * batch * seq + layers * 4 * batch * seq * seq * h


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_inspect_flops_agree_with_analytic_count(name, capsys):
    assert main(["inspect", name, "--json", "--batch", "2", "--seq", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = analytic_flops(zoo.tiny_config(name), 2, 16)
    got = data["total"]["flops"]
    print(f"{name}: table {got} analytic {want} ratio {got / want:.4f}")
    assert abs(got / want - 1) <= 0.05
    layers = {m["module"]: m for m in data["modules"]}
    cfg = zoo.tiny_config(name)
    per_layer = (analytic_flops(cfg, 2, 16) - 2 * cfg.hidden_size * cfg.vocab_size * 32) / cfg.num_hidden_layers
    assert abs(layers["model.layers.0"]["flops"] / per_layer - 1) <= 0.05


def test_inspect_prints_table_and_module_graph(capsys):
    assert main(["inspect", "llama", "--module", "model.layers.0.mlp", "--graph", "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.mlp.gate_proj.weight" in out
    assert "aten.silu" in out
    assert "share" in out.splitlines()[2]


def test_inspect_writes_picture(tmp_path, capsys):
    assert main(["inspect", "gpt2", "--dot", str(tmp_path / "gpt2.dot")]) == 0
    assert "subgraph cluster_" in (tmp_path / "gpt2.dot").read_text()
    assert f"wrote {tmp_path / 'gpt2.dot'}" in capsys.readouterr().out


def test_inspect_from_config_json_on_meta(tmp_path, capsys):
    cfg = zoo.tiny_config("qwen2", hidden_size=128, num_hidden_layers=3)
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    assert main(["inspect", str(path), "--meta", "--json", "--depth", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "Qwen2ForCausalLM" and data["hf"]["num_layers"] == 3


def test_bad_model_name_is_a_clear_error(capsys):
    assert main(["inspect", "no-such-model"]) == 2
    assert "'no-such-model' is neither a zoo name nor an existing path" in capsys.readouterr().err


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "fxpar", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "fxpar inspect llama" in out.stdout


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_a_command_without_a_process_group_ends_quickly_with_its_handlers_run_and_its_status():
    # fxpar.cli.run ends plan / inspect / zoo without the interpreter's teardown: what is printed, the exit
    # handlers and the status must survive it
    code = "import atexit; import fxpar.cli as c; atexit.register(print, 'handler ran'); c.run()"
    ok = _run([sys.executable, "-c", code, "zoo"])
    assert ok.returncode == 0 and "llama" in ok.stdout and ok.stdout.rstrip().endswith("handler ran"), ok
    bad = _run([sys.executable, "-c", code, "inspect", "no-such-model"])
    assert bad.returncode == 2 and "handler ran" in bad.stdout and "no-such-model" in bad.stderr, bad


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_help_shows_train_plan_and_examples():
    out = _run([sys.executable, "-m", "fxpar", "--help"]).stdout
    assert "train" in out and "plan" in out and "torchrun --nproc_per_node 8 -m fxpar train" in out


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_plan_command_shows_stages_collectives_and_memory():
    r = _run([sys.executable, "-m", "fxpar", "plan", "llama", "--plan", "dp=2,pp=2,tp=2,zero=1"])
    assert r.returncode == 0, r.stderr[-2000:]
    for text in ("DeviceMesh((dp_shard=2, pp=2, tp=2)", "pipeline: pp=2, 2 stages", "tensor parallel: tp=2",
                 "data parallel: dp=2, ZeRO-1", "memory per rank, predicted", "communication per step, predicted",
                 "activation memory per rank, predicted"):
        assert text in r.stdout, (text, r.stdout[-3000:])
    assert "measured" not in r.stdout  # nothing has run
    header = next(line for line in r.stdout.splitlines() if " traced with " in line)
    assert "predicted times are for " in r.stdout  # the device profile, named
    assert re.search(r"forward \d[\d.]*MFLOPs, backward \d[\d.]*MFLOPs per microbatch on one TP rank of 2", header)
    for layer in ("0", "1"):  # every layer costs something, forward and backward
        row = re.search(rf"^ +{layer} +\S+ +(\S+) +(\S+) ", r.stdout, re.M)
        assert row and "0" not in (row.group(1), row.group(2)), (layer, r.stdout[:2000])
    # DP (ZeRO-1: gradients all-reduced, fp32 shards gathered), TP and PP lines, bytes this rank sends
    for axis, collective, what in (("dp", "all_reduce", "gradients"), ("dp", "all_gather", "parameters"),
                                   ("tp", "all_reduce", "forward"), ("tp", "all_reduce", "backward"),
                                   ("pp", "send", "activations")):
        assert re.search(rf"^ *{axis} +{collective} +{what} +[1-9][\d.]*K?B +[1-9][\d.]*K?B$", r.stdout, re.M), \
            (axis, collective, what)
    grads = re.search(r"dp +all_reduce +gradients +(\S+) +(\S+)", r.stdout)
    gather = re.search(r"dp +all_gather +parameters +(\S+) +(\S+)", r.stdout)
    assert grads.group(1) == gather.group(1) == grads.group(2)  # ring all-reduce over 2 ranks: the payload
    assert re.search(r"^none \(plan\) +\S+", r.stdout, re.M)


@pytest.mark.slow
def test_train_under_torchrun_saves_and_resumes_under_another_plan(tmp_path, pool2):
    """`fxpar train` on 2 processes with pp=2 for 4 steps, saving every 2; then resumed with dp=2 from the
    step-2 checkpoint: weights and optimizer states (AdamW's moments: step 4's loss depends on them)
    reshard, so its steps 3 and 4 are the uninterrupted run's (same-plan resumption after a lost rank:
    tests/cli/test_train_resume.py). The first run is launched by torchrun; the resumed and the planned
    runs are the same command on a pool's 2 ranks (:func:`fxpar.testing.cli.fxpar_on_rank`)."""
    train = ["train", "llama", "--data", "synthetic", "--batch", "4", "--seq", "16", "--steps", "4",
             "--max-grad-norm", "0.5"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "fxpar"]
    first = _run(torchrun + train + ["--plan", "pp=2", "--save", str(tmp_path / "ckpt"), "--save-every", "2",
                                     "--export", str(tmp_path / "hf"), "--losses-out", str(tmp_path / "first.txt")])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "step 4/4  loss" in first.stdout and "tok/s" in first.stdout and "mem/rank" in first.stdout
    assert "grad norm" in first.stdout  # --max-grad-norm: the global norm logged (and clipped to 0.5)
    assert (tmp_path / "hf" / "model.safetensors").exists()
    (tmp_path / "ckpt" / "latest").write_text("step_00000002\n")  # resume from step 2, not the last save
    (rc, out, err), _ = pool2.run(fxpar_on_rank, train + ["--plan", "dp=2", "--resume", str(tmp_path / "ckpt"),
                                                          "--losses-out", str(tmp_path / "second.txt")])
    assert rc == 0, err[-3000:]
    assert "resuming from" in out and "step 4/4" in out and "afresh" not in out
    uninterrupted = [float(x) for x in (tmp_path / "first.txt").read_text().split()]
    resumed = [float(x) for x in (tmp_path / "second.txt").read_text().split()]
    assert len(uninterrupted) == 4 and len(resumed) == 2
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted[2:])) < 1e-5, (resumed, uninterrupted)
    # --plan auto: the planner chooses for the 2 ranks and the step's batch; the same losses as pp=2
    (rc, out, err), _ = pool2.run(fxpar_on_rank, train + ["--steps", "2", "--plan", "auto",
                                                          "--losses-out", str(tmp_path / "auto.txt")])
    assert rc == 0, err[-3000:]
    chosen = re.search(r"plan: (Plan\(.*?\))", out)
    assert chosen and "step 2/2" in out, out[-2000:]
    assert "plan 'auto': " in out and "  why: the fastest of " in out, out[-2000:]
    planned = [float(x) for x in (tmp_path / "auto.txt").read_text().split()]
    assert max(abs(a - b) for a, b in zip(planned, uninterrupted[:2])) < 1e-5, (chosen.group(1), planned, uninterrupted)


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
@pytest.mark.serial  # a wall-time bound
def test_plan_auto_on_the_70b_config_for_1024_h100s():
    """`fxpar plan <70B config> --meta --auto --world 1024`: the chosen plan (degrees multiplying to 1024), its
    MFU, the top 5 alternatives and the hand-made baseline; the whole process's wall time is printed (the
    target is under 10 s on the 2-core dev box; the bound here leaves room for a busy machine)."""
    import time
    from pathlib import Path

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "llama3-70b.json"
    cmd = [sys.executable, "-m", "fxpar", "plan", str(config), "--meta", "--auto", "--world", "1024",
           "--device", "h100-80gb", "--global-batch", "1024", "--seq", "8192"]
    start = time.perf_counter()
    r = _run(cmd)
    wall = time.perf_counter() - start
    print(f"fxpar plan --auto (70B, 1024 x h100-80gb): {wall:.1f} s wall")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    # each plan's ranks, cp's included (seq 8192 searches it)
    plans = re.findall(r"dp=(\d+)\D+pp=(\d+)\D+tp=(\d+)(?:(?:[ ,][^ ,:]+)*?[ ,]cp=(\d+))?", out)
    assert plans and all(int(d) * int(p) * int(t) * int(c or 1) == 1024 for d, p, t, c in plans), out[-3000:]
    chosen = re.search(r"^chosen plan: (.+)$", out, re.M).group(1).strip()
    rows = re.findall(r"^ *([1-9]) +(dp=.+?) {2,}\d", out, re.M)  # the top 5 table, best first (equal twins: one row)
    ranks = [int(r[0]) for r in rows]
    assert ranks[0] == 1 and ranks == sorted(set(ranks)) and ranks[-1] == 5 and len(ranks) >= 3, out[:3000]
    assert rows[0][1].strip() == chosen, out[:3000]
    assert re.search(r"MFU \d+(\.\d+)?%", out), out[-3000:]
    assert re.search(r"^ *base +dp=\d+ pp=\d+ tp=8 zero=1 ", out, re.M) and "hand-made" in out, out[:3000]
    assert "computing in bfloat16" in out  # the config's torch_dtype
    # the four phases each timed on their own, and together no more than the process's wall time
    phases = re.search(r"started and imported in ([\d.]+) s, model built in ([\d.]+) s, traced and costed in "
                       r"([\d.]+) s, searched in ([\d.]+) s", out)
    assert phases and 0 < sum(map(float, phases.groups())) <= wall, out[-500:]
    assert wall < 60, wall


def test_plan_auto_json_and_argument_errors(capsys):
    """`--json` carries the same choice as the text (best first, the world, the timings); `--auto` without
    `--world` and `--world` without `--auto` are errors that say what to pass."""
    args = ["plan", "llama", "--auto", "--world", "4", "--global-batch", "8", "--seq", "16", "--top", "3"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world"] == 4 and data["timings"]["plan_s"] > 0
    assert {"import_s", "build_s", "trace_s", "search_s"} <= set(data["timings"]) and data["timings"]["trace_s"] > 0
    assert main(["plan", "llama", "--auto"]) == 2 and "--world N" in capsys.readouterr().err
    assert main(["plan", "llama", "--world", "4"]) == 2 and "--auto" in capsys.readouterr().err
