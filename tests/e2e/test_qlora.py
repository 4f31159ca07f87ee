"""QLoRA (``Plan(base_dtype="int8" | "nf4")``): the PEFT model's frozen linear weights held as int8 or 4-bit
NormalFloat blocks and dequantized per layer. After two AdamW steps the adapters equal PEFT's on one process whose
base weights are the dequantized blocks (one process, and tp=2 where each rank quantizes its own shard, pp=2, dp=2,
dp=2 zero=3 where each rank holds half the blocks); the held base is at most 0.27x its fp32 bytes (int8), 0.15x
(nf4); a plan that cannot take it is refused."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar import zoo
from fxpar.ir import nf4, quant_ops
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


def _held(compiled, state, fmt: str) -> dict[str, torch.Tensor]:
    """Each quantized weight this rank holds (by FQN), dequantized; the bytes of codes + scales, and of every
    frozen tensor the rank holds (codes, scales, norms, buffers; under ZeRO-3 this rank's shards of them)."""
    out, nbytes, suffix = {}, 0, f"_{fmt}"
    for b in (b for bs in compiled.zero3_buckets.values() for b in bs):  # ZeRO-3: codes and scales sharded
        for name, n in zip(b.names, b.numels):
            if name.endswith((suffix, suffix + "_scales")):
                nbytes += n * b.shard.element_size() // b.dp
            if name.endswith(suffix):
                out[name.removesuffix(suffix)] = state[name.removesuffix(suffix)]  # gathered, dequantized, whole
    for s in compiled.pipeline.stages_of(compiled.pp_rank):
        bufs = dict(s.gm.named_buffers())
        for name, codes in bufs.items():
            if name.endswith(suffix):
                scales = bufs[name + "_scales"]
                fqn = name.removesuffix(suffix)
                out[fqn] = quant_ops.FORMATS[fmt][1](codes, scales, compiled.program.tensor(fqn).shape[1])
                nbytes += codes.numel() + scales.numel() * 4
    frozen = {id(t): t for s in compiled.pipeline.stages_of(compiled.pp_rank)
              for t in [*s.gm.parameters(), *s.gm.buffers()] if not t.requires_grad and not t.is_meta}
    return {"weights": out, "bytes": nbytes, "frozen": sum(t.numel() * t.element_size() for t in frozen.values())}


class Gathers(TorchDispatchMode):
    """ZeRO-3's bucket gathers while active (``fxpar::gather_params``: forward's and backward's regathers)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.name() == "fxpar::gather_params"
        return func(*args, **(kwargs or {}))


def qlora_run(plan: str, steps: int = 2, groups: bool = False, fmt: str = "int8") -> dict:
    """``steps`` AdamW steps of ``plan`` with the base in ``fmt`` blocks: losses, adapters, the held base; under
    ZeRO-3 the first step's bucket gathers, the buckets, and the frozen shards given a gradient. ``groups``:
    through ``param_groups`` (one group, the optimizer's defaults, as fxpar train's rule makes with no decay)."""
    batch = _batch()
    compiled = fxpar.compile(lora_llama(), f"{plan},base_dtype={fmt}", example_kwargs=batch, optimizer=adamw,
                             timeout=120, param_groups=(lambda fqn, p: {}) if groups else None)
    with Gathers() as gathers:
        losses = [compiled.step(**batch).item()]
    losses += [compiled.step(**batch).item() for _ in range(steps - 1)]
    buckets = [b for bs in compiled.zero3_buckets.values() for b in bs]
    zero3 = {"gathers": gathers.count, "buckets": len(buckets),
             "frozen_grads": sum(b.shard.grad is not None for b in buckets if not b.shard.requires_grad)}
    zero3["predicted"] = compiled.memory()["predicted"]["frozen"]  # the cost model's price of the held base
    state = compiled.full_state_dict()
    adapters = {n: state[n] for n, p in lora_llama().named_parameters() if p.requires_grad}
    held = _held(compiled, state, fmt)  # the state dict gives the quantized base as held: dequantized, whole
    return {"losses": losses, "adapters": adapters, "base": {k: state[k] for k in held["weights"]}, **held, **zero3}


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


def test_qlora_nf4_trains_as_peft_on_its_dequantized_base_and_holds_a_seventh():
    """4-bit NormalFloat blocks: the dequantized base within half the widest gap between NF4 levels of each
    block's absmax; two codes a byte + an fp32 scale per 64: 0.14x fp32 held."""
    r = qlora_run("dp=1", fmt="nf4")
    fp32 = sum(w.numel() * 4 for w in r["weights"].values())
    assert len(r["weights"]) == 2 * 7 + 2 and r["bytes"] <= 0.15 * fp32, (len(r["weights"]), r["bytes"], fp32)
    plain = lora_llama()
    base = sum(p.numel() * 4 for p in plain.parameters() if not p.requires_grad)
    assert r["frozen"] <= 0.15 * base, (r["frozen"], base)  # the whole base held: norms and buffers too
    assert abs(r["predicted"] - r["frozen"]) <= 0.03 * r["frozen"], (r["predicted"], r["frozen"])  # 0.5625 B/entry
    gap = max(b - a for a, b in zip(nf4.LEVELS, nf4.LEVELS[1:])) / 2  # -1 to -0.696
    for k, w in r["weights"].items():  # each row's error within its blocks' bound
        want = plain.get_parameter(k).detach()
        amax = torch.nn.functional.pad(want.abs(), (0, -want.shape[1] % 64)).view(want.shape[0], -1, 64).amax(-1)
        assert ((w - want).abs() <= amax.repeat_interleave(64, 1)[:, :want.shape[1]] * gap * 1.0001).all(), k
    _check([r])


def test_nf4_blocks_pack_two_levels_a_byte():
    w = torch.tensor([[2.0 * v for v in nf4.LEVELS[::-1]] + [0.5, -3.0]])  # every level once; a row of 18
    codes, scales = nf4.quantize_nf4(w, block=16)
    assert codes.dtype == torch.uint8 and codes.shape == (1, 16) and scales.tolist() == [[2.0, 3.0]]
    assert codes[0, :8].tolist() == [(15 - 2 * i) * 16 + 14 - 2 * i for i in range(8)]  # the even entry high
    assert torch.equal(nf4.dequantize_nf4(codes, scales, 18)[0, :16], w[0, :16])  # the levels exactly
    assert torch.equal(nf4.dequantize_nf4(codes, scales, 18)[0, 16:], torch.tensor([nf4.LEVELS[9], -1.0]) * 3)  # 0.161


@pytest.mark.slow
@pytest.mark.parametrize("plan,fmt", [("tp=2", "int8"), ("pp=2", "int8"), ("dp=2", "int8"), ("tp=2", "nf4"),
                                      ("pp=2", "nf4")])
def test_qlora_on_two_ranks(pool2, plan, fmt):
    """tp=2: each rank quantizes its own shard (a row layer's blocks within its half of the input features)."""
    results = pool2.run(qlora_run, plan, 2, False, fmt, timeout=300)
    assert all(r["weights"] for r in results)
    _check(results)


@pytest.mark.slow
def test_qlora_int8_under_zero3_shards_the_frozen_base_over_dp(pool2):
    """dp=2 zero=3: each rank holds half the codes and scales (frozen buckets of their own: codes, scales with
    the norms), gathered once per layer in forward and once in backward, never reduce-scattered."""
    results = pool2.run(qlora_run, "dp=2,zero=3", 2, True, timeout=300)
    _check(results)
    base = sum(p.numel() * 4 for p in lora_llama().parameters() if not p.requires_grad)
    for r in results:
        fp32 = sum(w.numel() * 4 for w in r["weights"].values())
        assert len(r["weights"]) == 2 * 7 + 2 and r["bytes"] <= 0.27 * fp32 / 2, (r["bytes"], fp32)
        assert r["frozen"] <= 0.27 * base / 2, (r["frozen"], base)  # codes, scales, norms: this rank's half
        assert abs(r["predicted"] - r["frozen"]) <= 0.03 * r["frozen"], (r["predicted"], r["frozen"])
        assert r["frozen_grads"] == 0 and r["gathers"] <= 2 * r["buckets"], r  # (one codes/scales slot: 4x more)


def test_qlora_refusals():
    with pytest.raises(PlanError, match="no frozen weight matrix to quantize"):
        fxpar.compile(zoo.build("llama", seed=0), "dp=1,base_dtype=int8", example_kwargs=_batch(), optimizer=adamw)
