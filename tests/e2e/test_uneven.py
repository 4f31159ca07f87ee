"""Dims the TP degree does not divide, cut unevenly (``torch.chunk``'s shares), end to end on gloo ranks
against one process: a Llama vocabulary of 32,001 at tp=2, an MLP width of 130 at tp=4 and GPT-2's
vocabulary of 50,257 (tied embedding and head) at tp=2, alone, with pp=2 and with dp=2 ZeRO-3 (losses,
every parameter after each step, the global gradient norm); the vocabulary-parallel fused loss, sequence
parallelism, a fused ``[gate | up]`` weight of 130 + 130 rows at tp=4; a checkpoint saved under an
uneven plan read back bitwise under tp=1 and under another uneven split; ``export_hf`` in the model's
own shapes, which ``from_pretrained`` loads to the same logits and tp=4 reads back; greedy generation
against HF ``generate``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

import fxpar
from fxpar import checkpoint, zoo
from fxpar.testing import multiproc
from fxpar.testing.compare import train_against_reference

TOL = 1e-5
STEPS = 2
NEW = 6  # generated tokens
pytestmark = pytest.mark.slow
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)
pool8 = multiproc.rank_pool(8)

# name -> (zoo model, config overrides): tiny widths, the dim under test at its real size
MODELS = {
    "vocab": ("llama", dict(vocab_size=32001, hidden_size=32, intermediate_size=64)),
    "mlp": ("llama", dict(hidden_size=32, intermediate_size=130)),
    "gpt2": ("gpt2", dict(vocab_size=50257, n_embd=32, n_inner=64)),
    "fused": ("phi3", dict(hidden_size=32, intermediate_size=130)),  # [gate | up] in one weight: 130 + 130 rows
}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)  # eps: see tests/runtime/test_data_parallel.py


def build(case: str, device=None):
    name, overrides = MODELS[case]
    if device == "meta":
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(zoo.tiny_config(name, **overrides)).train()
    return zoo.build(name, seed=0, **overrides)


def batch_of(case: str, rows: int = 4, seq: int = 8) -> dict:
    """Random ids, with the ids on both sides of every rank's boundary and the last id among them, so a
    wrong offset or share of the vocabulary changes the loss."""
    name, overrides = MODELS[case]
    batch = zoo.example_inputs(name, zoo.tiny_config(name, **overrides), batch=rows, seq=seq)
    vocab = zoo.tiny_config(name, **overrides).vocab_size
    step = -(-vocab // 2)
    edges = torch.tensor([0, step - 1, step, vocab - 1, step // 2, step + 1])
    batch["input_ids"][0, :len(edges)] = edges
    batch["labels"] = batch["input_ids"].clone()
    return batch


def train(case: str, plan: str) -> dict:
    """Losses and parameters against one process, and the last step's global gradient norm (every rank's
    share counted once; a bound too large to clip) against the reference's."""
    batch = batch_of(case)
    compiled = fxpar.compile(build(case), plan, example_kwargs=batch, optimizer=adamw, timeout=120,
                             max_grad_norm=1e9)
    reference = build(case)
    diffs = train_against_reference(compiled, reference, adamw, batch, STEPS)
    # in float64, as fxpar sums it (torch's fp32 norm of these 2M entries is itself 1e-5 off)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in reference.parameters()])).item()
    return {**diffs, "norm": abs(compiled.last_grad_norm - norm) / norm, "uneven": compiled.tp_info.uneven()}


def train_all(cases: list[tuple[str, str]]) -> dict:
    return {f"{case} {plan}": train(case, plan) for case, plan in cases}


SHARES = {"vocab": {"model.embed_tokens.weight": [16001, 16000], "lm_head.weight": [16001, 16000]},
          "gpt2": {"transformer.wte.weight": [25129, 25128]}}
MLP4 = {f"model.layers.{i}.mlp.{p}_proj.weight": [33, 33, 33, 31] for i in range(2) for p in ("gate", "up", "down")}
FUSED4 = {**{f"model.layers.{i}.mlp.gate_up_proj.weight": [66, 66, 66, 62] for i in range(2)},  # 33 + 33 of each
          **{f"model.layers.{i}.mlp.down_proj.weight": [33, 33, 33, 31] for i in range(2)}}


def _check(results: list[dict], expect: dict) -> None:
    for r in results:
        for key, got in r.items():
            assert got["loss"] <= TOL and got["weights"] <= TOL and got["norm"] <= TOL, (key, got)
            case = key.split()[0]
            assert all(got["uneven"].get(k) == v for k, v in expect[case].items()), (key, got["uneven"])


def test_tp2_alone_with_the_fused_loss_and_sequence_parallel(pool2):
    cases = [("vocab", "tp=2"), ("gpt2", "tp=2"), ("vocab", "tp=2,fused_loss=true"),
             ("vocab", "tp=2,sequence_parallel=true")]
    _check(pool2.run(train_all, cases, timeout=300), SHARES)


def test_uneven_tp2_with_pp2_and_zero3_and_tp4_alone(pool4):
    cases = [(c, p) for c in ("vocab", "gpt2") for p in ("tp=2,pp=2", "dp=2,tp=2,zero=3")] + \
        [("mlp", "tp=4"), ("fused", "tp=4")]
    _check(pool4.run(train_all, cases, timeout=600), {**SHARES, "mlp": MLP4, "fused": FUSED4})


def test_mlp_width_130_at_tp4_with_pp2_and_zero3(pool8):
    cases = [("mlp", "tp=4,pp=2"), ("mlp", "dp=2,tp=4,zero=3")]
    _check(pool8.run(train_all, cases, timeout=600), {"mlp": MLP4})


def save_reload_export(directory: str) -> dict:
    """Train under tp=2 x pp=2 (vocabulary 32,001) and save; read the checkpoint into a meta model under
    dp=4 (tp=1), tp=4 (shares 8001 x 3 + 7998) and dp=2 x tp=2 ZeRO-3; export to HF format, and read the
    export under tp=4."""
    batch = batch_of("vocab")
    run = fxpar.compile(build("vocab"), "tp=2,pp=2", example_kwargs=batch, optimizer=adamw, timeout=120)
    for _ in range(STEPS):
        run.step(**batch)
    path = checkpoint.save(run, directory, STEPS)
    saved = run.full_state_dict()
    out = {}
    for plan in ("dp=4", "tp=4", "dp=2,tp=2,zero=3"):  # ZeRO-3: each rank reads only its bucket entries
        loaded = fxpar.compile(build("vocab", "meta"), plan, example_kwargs=batch, optimizer=adamw,
                               weights=checkpoint.model_source(path), timeout=120)
        full = loaded.full_state_dict()
        out[plan] = [k for k in saved if not torch.equal(full[k], saved[k])]
        out[plan + " uneven"] = loaded.tp_info.uneven()
    export = os.path.join(directory, "hf")
    checkpoint.export_hf(run, export)
    infer = {k: v for k, v in batch.items() if k != "labels"}
    logits = run(**infer).logits
    dist.barrier()
    hf = transformers.AutoModelForCausalLM.from_pretrained(export)
    out["export_logits"] = (hf(**infer).logits - logits).abs().max().item()
    out["logits_shape"] = tuple(logits.shape)
    with safe_open(os.path.join(export, "model.safetensors"), framework="pt") as f:
        out["shapes"] = {k: tuple(f.get_slice(k).get_shape()) for k in ("model.embed_tokens.weight", "lm_head.weight")}
    from_export = fxpar.compile(build("vocab", "meta"), "tp=4", example_kwargs=batch, optimizer=adamw, weights=export,
                                timeout=120)  # each rank reads its share of the safetensors entries
    full = from_export.full_state_dict()
    out["from export"] = [k for k in saved if not torch.equal(full[k], saved[k])]
    return out


def test_checkpoint_reloads_under_other_plans_and_exports(tmp_path, pool4):
    for r in pool4.run(save_reload_export, str(tmp_path / "ckpt"), timeout=600):
        assert r["dp=4"] == r["tp=4"] == r["dp=2,tp=2,zero=3"] == r["from export"] == [], "weights changed across plans"
        assert r["tp=4 uneven"]["lm_head.weight"] == [8001, 8001, 8001, 7998] and r["dp=4 uneven"] == {}
        assert r["shapes"] == {"model.embed_tokens.weight": (32001, 32), "lm_head.weight": (32001, 32)}
        assert r["logits_shape"][-1] == 32001 and r["export_logits"] <= TOL, r


def generate_cases() -> dict:
    out = {}
    for case in ("vocab", "gpt2"):
        batch = batch_of(case, rows=2)
        compiled = fxpar.compile(build(case), "tp=2", example_kwargs=batch, optimizer=adamw, timeout=120)
        infer = {k: v for k, v in batch.items() if k != "labels"}
        reference = build(case).eval()
        with torch.no_grad():
            ref_logits = reference(**infer).logits
        out[case + " logits"] = (compiled(**infer).logits - ref_logits).abs().max().item()
        prompt = batch["input_ids"][:, :4]
        out[case] = compiled.generate(prompt, NEW)
        ref = reference.generate(prompt, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(prompt))
        out[case + " equal"] = torch.equal(out[case], ref)
    return out


def test_greedy_generation_matches_hf(pool2):
    for r in pool2.run(generate_cases, timeout=300):
        for case in ("vocab", "gpt2"):
            assert r[case + " logits"] <= TOL and r[case + " equal"], (case, r)
