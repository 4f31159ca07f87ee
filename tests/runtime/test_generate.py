"""``CompiledModel.generate`` against Hugging Face ``model.generate`` on the same weights: greedy under
tp=2 (with the KV cache sharded by heads, and without a cache), pp=2 and dp=2 on a left-padded batch
(llama from a saved model directory), gpt2 (tied embedding, learned positions) under tp=2, sampling with
the seed HF uses (the same tokens, on every rank), and the model ``export_hf`` writes after training
steps; the sampling warps against transformers' own; ``fxpar generate`` in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import fxpar
from fxpar import checkpoint
from fxpar.ir.errors import PlanError
from fxpar.runtime.generate import warp
from fxpar.testing import multiproc
from fxpar.testing.hfdir import make_model_dir
from fxpar.train.models import directory_weights, load_model

pool2 = multiproc.rank_pool(2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("gen") / "llama", "llama")
NEW = 8
PROMPTS = ["Hello there, how are", "What is", "Tell me"]
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.9)


def prompts(directory) -> dict:
    tok = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    tok.padding_side = "left"
    return dict(tok(PROMPTS, return_tensors="pt", padding=True))


def compiled_for(directory: str, plan: str):
    """The directory's model built on the meta device, each rank reading its shards, compiled for ``plan``."""
    batch = prompts(directory)
    ids = batch["input_ids"][:2]
    return fxpar.compile(load_model(directory), plan,
                         example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False},
                         weights=directory_weights(Path(directory)), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         timeout=120)


def hf_generate(directory, batch: dict, seed: int | None = None) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    if seed is None:
        return model.generate(**batch, max_new_tokens=NEW, do_sample=False)
    torch.manual_seed(seed)  # HF samples from the global generator; fxpar from one seeded alike
    return model.generate(**batch, max_new_tokens=NEW, do_sample=True, **SAMPLING)


def cache_layout(compiled) -> dict:
    """What the KV-cache programs hold on this rank: the head count of each key/value cache input (the
    placeholder's local shape), and the all-gathers of the one-token decode program."""
    heads, gathers = set(), None
    for result, _, _ in compiled.programs.entries.values():
        program = result.program
        cache = [n for n in program.graph.nodes if n.op == "placeholder" and n.name.startswith("past_key_values")]
        heads |= {n.meta["val"].shape[1] for n in cache if n.meta["val"].dim() == 4}
        ids = next(n for n in program.graph.nodes if n.name == "input_ids")
        if cache and ids.meta["val"].shape[1] == 1:
            gathers = sum(n.target == torch.ops.fxpar.all_gather.default
                          for s in result.pipeline.stages for n in s.gm.graph.nodes)
    return {"heads": heads, "gathers": gathers}


def llama_cases(directory: str) -> dict:
    batch, out = prompts(directory), {}
    kw = {"attention_mask": batch["attention_mask"]}
    for plan in ("tp=2", "pp=2", "dp=2"):
        compiled = compiled_for(directory, plan)
        out[plan] = compiled.generate(batch["input_ids"], NEW, **kw)  # tp=2: the KV cache; pp, dp: the window
        if plan == "tp=2":
            out["layout"] = cache_layout(compiled)
            out["tp=2 window"] = compiled.generate(batch["input_ids"], NEW, cache=False, **kw)
            out["sampled"] = [compiled.generate(batch["input_ids"], NEW, do_sample=True, seed=3, **SAMPLING, **kw)
                              for _ in range(2)]
            out["top_k=1"] = compiled.generate(batch["input_ids"], NEW, do_sample=True, top_k=1, **kw)
        else:
            with pytest.raises(PlanError, match="KV-cache path"):
                compiled.generate(batch["input_ids"], NEW, cache=True, **kw)
    return out


@pytest.mark.slow
def test_greedy_and_sampling_match_hf_under_tp_pp_dp(pool2, llama_dir):
    directory = llama_dir
    per_rank = pool2.run(llama_cases, str(directory), timeout=300)
    batch = prompts(directory)
    greedy, sampled = hf_generate(directory, batch), hf_generate(directory, batch, seed=3)
    assert batch["attention_mask"].min() == 0 and greedy.shape == (3, batch["input_ids"].shape[1] + NEW)
    kv_heads = transformers.AutoConfig.from_pretrained(directory, local_files_only=True).num_key_value_heads
    for r in per_rank:
        for plan in ("tp=2", "tp=2 window", "pp=2", "dp=2", "top_k=1"):
            assert torch.equal(r[plan], greedy), (plan, r[plan], greedy)
        # each rank's cache holds its own heads; decoding a token gathers only the logits
        assert r["layout"] == {"heads": {kv_heads // 2}, "gathers": 1}, r["layout"]
        assert torch.equal(r["sampled"][0], sampled) and torch.equal(r["sampled"][1], sampled), (r, sampled)
    assert not torch.equal(sampled, greedy)


def gpt2_and_export_cases(gpt2: str, llama: str, export: str) -> dict:
    """gpt2 under tp=2; llama under tp=2 after two training steps, then exported."""
    compiled = compiled_for(gpt2, "tp=2")
    out = {"gpt2": compiled.generate(prompts(gpt2)["input_ids"][:1], NEW), "layout": cache_layout(compiled)}
    compiled, batch = compiled_for(llama, "tp=2"), prompts(llama)
    ids = batch["input_ids"][:2]
    for _ in range(2):
        compiled.step(input_ids=ids, labels=ids, use_cache=False)
    checkpoint.export_hf(compiled, export)
    out["trained"] = compiled.generate(batch["input_ids"], NEW, attention_mask=batch["attention_mask"])
    return out


@pytest.mark.slow
def test_gpt2_tp2_and_exported_model_match_hf(pool2, llama_dir, tmp_path):
    gpt2, llama = make_model_dir(tmp_path / "gpt2", "gpt2"), llama_dir
    export = tmp_path / "exported"
    per_rank = pool2.run(gpt2_and_export_cases, str(gpt2), str(llama), str(export), timeout=300)
    ref_gpt2 = hf_generate(gpt2, {"input_ids": prompts(gpt2)["input_ids"][:1]})
    batch = prompts(llama)
    trained, untrained = hf_generate(export, batch), hf_generate(llama, batch)
    assert not torch.equal(trained, untrained)  # the steps changed the weights the export holds
    heads = transformers.AutoConfig.from_pretrained(gpt2, local_files_only=True).n_head
    for r in per_rank:
        assert torch.equal(r["gpt2"], ref_gpt2), (r["gpt2"], ref_gpt2)
        # the fused c_attn's heads; decoding a token gathers only the logits of the vocabulary-parallel
        # tied head (as llama's)
        assert r["layout"] == {"heads": {heads // 2}, "gathers": 1}, r["layout"]
        assert torch.equal(r["trained"], trained), (r["trained"], trained)


def test_warp_matches_transformers_processors():
    """Temperature, then top-k, then top-p, as transformers' logits warpers do them."""
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, k, p in ((1.0, None, None), (0.7, 10, None), (1.3, None, 0.8), (0.5, 5, 0.6), (1.0, 1, None)):
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if k is not None:
            ref = TopKLogitsWarper(k)(None, ref)
        if p is not None:
            ref = TopPLogitsWarper(p)(None, ref)
        got = warp(logits, temperature, k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref)), (temperature, k, p)
        assert torch.allclose(got[~torch.isinf(got)], ref[~torch.isinf(ref)]), (temperature, k, p)


def test_eos_bad_inputs_and_one_process(llama_dir):
    """One process: a sequence stops at its end-of-sequence id and is padded after, as HF; the loop stops
    when all have; bad arguments are PlanErrors that name the fix."""
    directory = llama_dir
    batch = prompts(directory)
    compiled = compiled_for(str(directory), "dp=1")
    first = hf_generate(directory, batch)[:, batch["input_ids"].shape[1]]  # each row's first new token
    eos = int(first[0])  # row 0 ends at once; the others go on until NEW tokens (or until they emit it)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    ref = model.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = compiled.generate(batch["input_ids"], NEW, attention_mask=batch["attention_mask"], eos_token_id=eos,
                            pad_token_id=0)
    assert torch.equal(got, ref), (got, ref)
    assert (got[0, batch["input_ids"].shape[1] + 1:] == 0).all()
    for kwargs, match in ((dict(temperature=0.0, do_sample=True), "temperature"), (dict(top_k=0), "top_k"),
                          (dict(top_p=1.5), "top_p"), (dict(attention_mask=torch.ones(1, 2)), "attention_mask")):
        with pytest.raises(PlanError, match=match):
            compiled.generate(batch["input_ids"], 2, **kwargs)
    with pytest.raises(PlanError, match="max_new_tokens"):
        compiled.generate(batch["input_ids"], -1)


@pytest.mark.slow  # seconds: a subprocess, several ranks or a large meta model; ./dev test runs it
def test_cli_prints_hf_continuations(llama_dir, capsys):
    """``fxpar generate`` in one process: a batch of raw prompts, then one chat prompt (the template with
    its generation prompt), each continuation what HF generates and decodes."""
    from fxpar.cli import main

    tok = transformers.AutoTokenizer.from_pretrained(llama_dir, local_files_only=True)
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                   add_generation_prompt=True)
    tok.padding_side = "left"
    cases = [(PROMPTS[1:], [], dict(tok(PROMPTS[1:], return_tensors="pt", padding=True))),
             (PROMPTS[:1], ["--chat"], dict(tok([chat], return_tensors="pt", add_special_tokens=False)))]
    for texts, flags, batch in cases:
        argv = ["generate", str(llama_dir), "--max-new-tokens", str(NEW), *flags]
        assert main(argv + [a for t in texts for a in ("--prompt", t)]) == 0
        ref = hf_generate(llama_dir, batch)[:, batch["input_ids"].shape[1]:]
        want = [tok.decode(row, skip_special_tokens=True) for row in ref]
        assert capsys.readouterr().out == "".join(w + "\n" for w in want), want
