"""Chat fine-tuning with ``fxpar train`` under torchrun next to HF Trainer on one process, in one run.

A tiny sharded checkpoint with a trained tokenizer (``fxpar.testing.hfdir``), the shipped chat file, and
the recipe of ``fxpar.testing.finetune.Recipe`` (warm-up + cosine, clipping at 1.0, 2-batch accumulation,
weight decay 0.1). Trainer reads the rows in fxpar's order (its sampler replaced); everything else is
its own. Per plan: the worst per-step loss difference to Trainer, the last loss, the evaluation loss,
and the wall time of the whole command (start-up included) next to Trainer's ``train()``. CPU times of
a model this small say nothing about speed at scale: the point is equality.

    OMP_NUM_THREADS=1 .venv/bin/python bench/finetune_vs_trainer.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from fxpar.testing.finetune import Recipe, reference_losses, trainer_losses
    from fxpar.testing.hfdir import CHAT_FILE, make_model_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--plans", default="dp=2,tp=2;pp=2,tp=2,zero=1;dp=4")
    p.add_argument("--nproc", type=int, default=4)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fxpar-ft-"))
    model_dir = make_model_dir(tmp / "model", "llama")
    recipe = Recipe(str(model_dir), str(CHAT_FILE), steps=args.steps,
                    eval_data=str(CHAT_FILE.with_name("chat_eval.jsonl")))
    t0 = time.perf_counter()
    trainer = trainer_losses(recipe, str(tmp / "trainer"))
    t_trainer = time.perf_counter() - t0
    plain = reference_losses(recipe)
    print(f"Trainer (1 process): {t_trainer:.1f} s, last loss {trainer[-1]:.4f}; plain loop vs Trainer: "
          f"{max(abs(a - b) for a, b in zip(plain['losses'], trainer)):.2e}; eval before/after "
          f"{plain['evals'][0]:.4f} / {plain['evals'][1]:.4f}")
    print(f"{'plan':24s} {'vs Trainer':>10s} {'last loss':>9s} {'eval after':>10s} {'wall s':>7s} {'/Trainer':>8s}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for plan in args.plans.split(";"):
        name = plan.replace(",", "_").replace("=", "")
        losses, metrics = tmp / f"{name}.losses", tmp / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
               "-m", "fxpar", "train", *recipe.argv(plan), "--losses-out", str(losses), "--metrics-out", str(metrics),
               "--log-every", str(args.steps)]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        wall = time.perf_counter() - t0
        if run.returncode != 0:
            print(f"{plan}: failed\n{run.stderr[-2000:]}")
            return 1
        got = [float(x) for x in losses.read_text().split()]
        evals = [json.loads(x)["eval_loss"] for x in metrics.read_text().splitlines() if "eval_loss" in x]
        diff = max(abs(a - b) for a, b in zip(got, trainer))
        print(f"{plan:24s} {diff:10.2e} {got[-1]:9.4f} {evals[-1]:10.4f} {wall:7.1f} {wall / t_trainer:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
