"""Chat fine-tuning with ``fxpar train`` on 4 gloo ranks against one process.

The recipe (``fxpar.testing.finetune.Recipe``): a sharded ``save_pretrained`` directory with a trained BPE
tokenizer and chat template, the shipped chat file packed into 64-token windows (labels only on the
assistant's tokens), AdamW with Trainer's weight-decay groups, warm-up + cosine, clipping at 1.0 and
2-batch accumulation, 20 steps. Under dp=2 x tp=2 and pp=2 x tp=2 (zero=1) every step's loss is within
1e-4 of the plain single-process loop; resuming at step 10 gives the uninterrupted losses exactly under
the same plan and, under the other plan, loads the same weights (bitwise) and data position.
"""

from __future__ import annotations

import json

import pytest

from fxpar.testing import multiproc
from fxpar.testing.finetune import Recipe, reference_losses
from fxpar.testing.hfdir import CHAT_FILE, make_model_dir

pool4 = multiproc.rank_pool(4)
TOL = 1e-4
PLANS = {"dp2_tp2": "dp=2,tp=2", "pp2_tp2": "pp=2,tp=2,zero=1"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("model"), "llama")
    return Recipe(str(path), str(CHAT_FILE), eval_data=str(CHAT_FILE.with_name("chat_eval.jsonl")))


@pytest.fixture(scope="module")
def reference(recipe):
    return reference_losses(recipe)


def _train(argv: list[str]) -> int:
    from fxpar.cli import train

    return train.main(argv)


def _resume_check(argv: list[str], ckpt: str) -> dict:
    """Resume ``argv`` from ``ckpt``'s latest: the weights compiled under this plan against the saved ones,
    the data position against the saved one; then train to the end."""
    import torch

    from fxpar import checkpoint
    from fxpar.cli import train
    from fxpar.train.loop import FineTune

    parser = __import__("argparse").ArgumentParser()
    train.add_arguments(parser)
    run = FineTune(parser.parse_args(argv))
    path = checkpoint.latest(ckpt)
    saved = checkpoint.load_model_state(path)
    mine = run.compiled.full_state_dict()
    same = all(torch.equal(mine[k], saved[k]) for k in saved) and set(saved) <= set(mine)
    data = run.data_start == checkpoint.info(path)["extra"]["data"]
    run.run()
    return {"weights_equal": same, "data_equal": data, "start": run.start}


def _losses(path) -> list[float]:
    return [float(x) for x in path.read_text().split()]


@pytest.fixture(scope="module")
def runs(pool4, recipe, tmp_path_factory):
    """name -> the directory of that plan's 20-step run (losses, metrics; dp=2 x tp=2 also saves at 10)."""
    done = {}

    def get(name: str):
        if name not in done:
            d = tmp_path_factory.mktemp(name)
            extra = ["--losses-out", str(d / "losses"), "--metrics-out", str(d / "metrics.jsonl"),
                     "--log-every", "5", "--save", str(d / "ckpt"), "--save-every", "10"]
            assert pool4.run(_train, recipe.argv(PLANS[name]) + extra) == [0] * 4
            done[name] = d
        return done[name]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANS))
def test_chat_finetuning_matches_one_process(recipe, reference, runs, name):
    d = runs(name)
    got = _losses(d / "losses")
    diff = max(abs(a - b) for a, b in zip(got, reference["losses"]))
    print(f"{name}: worst loss difference {diff:.2e} over {len(got)} steps; first {got[0]:.4f}, last {got[-1]:.4f}")
    assert len(got) == recipe.steps and diff <= TOL
    assert got[-1] < got[0] - 0.5  # it learns
    records = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]  # before and after; each sample once over dp
    records = [r for r in records if "eval_loss" not in r]
    assert [r["step"] for r in evals] == [0, recipe.steps]
    eval_diff = max(abs(r["eval_loss"] - e) for r, e in zip(evals, reference["evals"]))
    print(f"{name}: evaluation loss before / after {evals[0]['eval_loss']:.4f} / {evals[-1]['eval_loss']:.4f}, "
          f"worst difference to one process {eval_diff:.2e}")
    assert eval_diff <= TOL, (evals, reference)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for r in records:
        assert abs(r["grad_norm"] - reference["norms"][r["step"] - 1]) <= 1e-4
        assert len(r["mem_mib_per_rank"]) == 4 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANS))
def test_resume_at_step_10(pool4, recipe, runs, tmp_path, name):
    """Resumed from dp=2 x tp=2's step-10 checkpoint: under the same plan the losses are the uninterrupted
    ones exactly; under pp=2 x tp=2 the weights and the data position are those saved, the losses the
    uninterrupted ones up to the other plan's summation order."""
    saved = runs("dp2_tp2")
    whole = _losses(saved / "losses")
    (saved / "ckpt" / "latest").write_text("step_00000010\n")  # it also saved at 20
    losses = tmp_path / "losses"
    argv = recipe.argv(PLANS[name]) + ["--resume", str(saved / "ckpt"), "--losses-out", str(losses),
                                       "--log-every", "10"]
    out = pool4.run(_resume_check, argv, str(saved / "ckpt"))
    assert all(o["weights_equal"] and o["data_equal"] and o["start"] == 10 for o in out), out
    resumed = _losses(losses)
    assert len(resumed) == 10
    print(f"resumed under {PLANS[name]}: steps 11-20 differ from the uninterrupted run by "
          f"{max(abs(a - b) for a, b in zip(resumed, whole[10:])):.2e}")
    if name == "dp2_tp2":
        assert resumed == whole[10:]
    else:
        assert max(abs(a - b) for a, b in zip(resumed, whole[10:])) <= 1e-5


def test_reference_loop_is_hf_trainer(recipe, reference, tmp_path):
    """The single-process reference above is HF Trainer itself up to rounding: Trainer with only its sampler
    replaced (so that it reads the rows in fxpar's order) logs the same losses within 1e-5."""
    from fxpar.testing.finetune import trainer_losses

    logged = trainer_losses(recipe, str(tmp_path))
    diff = max(abs(a - b) for a, b in zip(logged, reference["losses"]))
    print(f"Trainer vs the reference loop: worst loss difference {diff:.2e} over {len(logged)} steps")
    assert len(logged) == recipe.steps and diff <= 1e-5


def _example(argv: list[str]) -> int:
    import importlib.util

    from fxpar.testing.hfdir import CHAT_FILE

    path = CHAT_FILE.parents[1] / "finetune_hf.py"
    spec = importlib.util.spec_from_file_location("finetune_hf_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.mark.slow
def test_worked_example_runs_on_4_ranks(pool4, tmp_path, capfd):
    """examples/finetune_hf.py, shortened to 6 steps: it writes the checkpoint, evaluates, answers before and
    after and exports a model from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    argv = ["--model", str(tmp_path / "tiny-chat"), "--out", str(tmp_path / "ft"), "--steps", "6"]
    assert pool4.run(_example, argv) == [0] * 4
    out = capfd.readouterr().out
    assert "eval at step 0" in out and "eval at step 6" in out and "step 6/6" in out
    assert "before fine-tuning:" in out and "after fine-tuning:" in out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ft") is not None
