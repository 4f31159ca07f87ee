"""QLoRA (``Plan(base_dtype="int8")``): the PEFT model's frozen linear weights held as int8 blocks and dequantized
per layer. After two AdamW steps the adapters equal PEFT's on one process whose base weights are the dequantized
blocks (one process, and tp=2 where each rank quantizes its own shard); the held base is at most 0.27x its fp32
bytes; a plan that cannot take it is refused."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import fxpar
from fxpar import zoo
from fxpar.ir import quant_ops
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool(2, shared=True)
TOL = 1e-5


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)


def lora_llama():
    """The zoo's tiny Llama, PEFT adapters (B drawn too) on a column (q, v) and a row (o, down) layer each."""
    model = zoo.build("llama", seed=0)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def _batch():
    return zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=4, seq=8)


def _held(compiled) -> dict[str, torch.Tensor]:
    """Each quantized weight this rank holds (by FQN), dequantized; the bytes of codes + scales, and of every
    frozen tensor the rank holds (codes, scales, norms, buffers)."""
    out, nbytes = {}, 0
    for s in compiled.pipeline.stages_of(compiled.pp_rank):
        bufs = dict(s.gm.named_buffers())
        for name, codes in bufs.items():
            if name.endswith("_int8"):
                scales = bufs[name + "_scales"]
                fqn = name[:-len("_int8")]
                out[fqn] = quant_ops.dequantize_rows(codes, scales, compiled.program.tensor(fqn).shape[1])
                nbytes += codes.numel() + scales.numel() * 4
    frozen = {id(t): t for s in compiled.pipeline.stages_of(compiled.pp_rank)
              for t in [*s.gm.parameters(), *s.gm.buffers()] if not t.requires_grad and not t.is_meta}
    return {"weights": out, "bytes": nbytes, "frozen": sum(t.numel() * t.element_size() for t in frozen.values())}


def qlora_run(plan: str, steps: int = 2) -> dict:
    """``steps`` AdamW steps of ``plan`` with the base in int8: losses, adapters, the held base."""
    batch = _batch()
    compiled = fxpar.compile(lora_llama(), plan + ",base_dtype=int8", example_kwargs=batch, optimizer=adamw,
                             timeout=120)
    losses = [compiled.step(**batch).item() for _ in range(steps)]
    state = compiled.full_state_dict()
    adapters = {n: state[n] for n, p in lora_llama().named_parameters() if p.requires_grad}
    held = _held(compiled)  # the state dict gives the quantized base as held: dequantized, whole
    return {"losses": losses, "adapters": adapters, "base": {k: state[k] for k in held["weights"]}, **held}


def _reference(shards: list[dict[str, torch.Tensor]], steps: int = 2):
    """PEFT on one process, each quantized base weight replaced by the ranks' dequantized shards put together."""
    model = lora_llama()
    batch = _batch()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for fqn in {k for s in shards for k in s}:  # a stage's weights on its ranks, TP shards on each
            full = params[fqn]
            parts = [s[fqn] for s in shards if fqn in s]
            dim = 0 if parts[0].shape[0] != full.shape[0] else 1
            full.copy_(torch.cat(parts, dim) if parts[0].shape != full.shape else parts[0])
    adapters = [p for p in model.parameters() if p.requires_grad]
    opt, losses = adamw(adapters), []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, \
        {n: params[n].detach() for s in shards for n in s}


def _check(results):
    losses, adapters, base = _reference([r["weights"] for r in results])
    for r in results:
        assert all(torch.equal(v, base[k]) for k, v in r["base"].items())  # the state dict's base: as held
        assert max(abs(a - b) for a, b in zip(r["losses"], losses)) <= TOL, (r["losses"], losses)
        assert max((r["adapters"][k] - v).abs().max().item() for k, v in adapters.items()) <= TOL
    return losses


def test_qlora_int8_trains_as_peft_on_its_dequantized_base_and_holds_a_quarter():
    r = qlora_run("dp=1")
    fp32 = sum(w.numel() * 4 for w in r["weights"].values())  # 7 linears per layer and the LM head
    assert len(r["weights"]) == 2 * 7 + 2 and r["bytes"] <= 0.27 * fp32, (len(r["weights"]), r["bytes"], fp32)
    plain = lora_llama()  # the dequantized base is the base within the int8 bound, not the base itself
    base = sum(p.numel() * 4 for p in plain.parameters() if not p.requires_grad)
    assert r["frozen"] <= 0.27 * base, (r["frozen"], base)  # the whole base held: norms and buffers too
    err = max((w - plain.get_parameter(k)).abs().max().item() for k, w in r["weights"].items())
    assert 0 < err <= max(plain.get_parameter(k).abs().max().item() for k in r["weights"]) / 254 * 1.01
    _check([r])


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["tp=2", "pp=2", "dp=2"])
def test_qlora_int8_on_two_ranks(pool2, plan):
    """tp=2: each rank quantizes its own shard (a row layer's blocks within its half of the input features)."""
    results = pool2.run(qlora_run, plan, timeout=300)
    assert all(r["weights"] for r in results)
    _check(results)


def test_qlora_refusals():
    with pytest.raises(PlanError, match="base_dtype='int8' with zero=3"):
        fxpar.compile(lora_llama(), "dp=1,zero=3,base_dtype=int8", example_kwargs=_batch(), optimizer=adamw)
    with pytest.raises(PlanError, match="no frozen weight matrix to quantize"):
        fxpar.compile(zoo.build("llama", seed=0), "dp=1,base_dtype=int8", example_kwargs=_batch(), optimizer=adamw)
