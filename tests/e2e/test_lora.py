"""PEFT LoRA models compiled as they are (``get_peft_model`` on a zoo model, PEFT's parameter names), on gloo
ranks against PEFT on one process: after two AdamW steps (weight decay on) every adapter weight equals the
single-process run's and every frozen base weight is bit-unchanged, under one process, dp=2, ZeRO-1, ZeRO-3,
pp=2 (a Llama, and a GPT-2 with its tied embedding on both stages), tp=2 (LoRA, DoRA, rsLoRA) and dp=2 x tp=2
ZeRO-3. A frozen parameter costs no gradient, no optimizer state and no reduction: the bytes the step's gradient
reductions move are the adapters' (and the loss's) only; ZeRO-3 shards the frozen base too (each rank holds half
of it) and gathers it for forward and backward without ever reducing it. Under tp=2 each adapter is cut as its
layer and adds one r-wide collective (counted)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
import fxpar.api
from fxpar import checkpoint, zoo
from fxpar.cost import comm
from fxpar.ir.errors import PlanError
from fxpar.testing import multiproc

TOL = 1e-5
NAME = "llama"
MAX_NORM = 0.05  # below every step's gradient norm (asserted), so clipping scales the adapters' gradients
pool2 = multiproc.rank_pool(2, shared=True)
pool4 = multiproc.rank_pool(4)
pytestmark = pytest.mark.slow


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-6)  # weight decay 0.01: a frozen weight stepped would move


COLUMN, ROW = ["q_proj", "v_proj"], ["o_proj", "down_proj"]  # adapted layers TP cuts by output / input features
R = 4


# GPT-2: Conv1D layers (PEFT's fan_in_fan_out), a fused [q | k | v] projection, tied embedding and LM head
TARGETS = {"llama": COLUMN + ROW, "gpt2": ["c_attn", "c_proj"]}


VARIANTS = {"lora": {}, "dora": {"use_dora": True}, "rslora": {"use_rslora": True}}


def lora_llama(name: str = NAME, variant: str = "lora"):
    """The zoo's tiny ``name`` wrapped by PEFT (the Llama's adapters on q, v, o and down);
    ``init_lora_weights=False`` draws B too, so both factors get gradients from the first step."""
    model = zoo.build(name, seed=0)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=R, target_modules=TARGETS[name], lora_dropout=0.0,
                                            init_lora_weights=False, **VARIANTS[variant]))


def _batch(name: str = NAME):
    return zoo.example_inputs(name, zoo.tiny_config(name), batch=4, seq=8)


class ReduceTap(TorchDispatchMode):
    """Bytes every reduction moves while active: the engine's torch.distributed all-reduces and reduce-scatters
    (c10d ops: gradient buckets, the step's loss) and ZeRO-3's reduce-scatters (fxpar's op, its gathers'
    backward). TP's own collectives are fxpar's all_reduce, not counted here."""

    OPS = {("c10d", "allreduce_"), ("c10d", "_reduce_scatter_base_"), ("c10d", "reduce_scatter_"),
           ("fxpar", "reduce_scatter")}

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func.namespace, func._schema.name.split("::")[-1]) in self.OPS:
            t = args[1] if func._schema.name.endswith("reduce_scatter_") else args[0]
            self.bytes += sum(x.numel() * x.element_size() for x in (t if isinstance(t, list) else [t]))
        return out


def lora_training(plan: str, name: str = NAME, variant: str = "lora", steps: int = 2, make=None,
                  batch=None) -> dict:
    """``steps`` AdamW steps of ``plan`` next to PEFT's model on one process: the largest loss and adapter
    differences, the base weights that moved; from the first step, the reduced bytes, the optimizer's state
    entries and the frozen parameters held (entries) and given a gradient on this rank. ``make()`` (a fresh
    PEFT model, the same on every call) and ``batch`` stand in for the zoo's ``name`` (bench/lora_sweep.py)."""
    make = make or (lambda: lora_llama(name, variant))
    batch = _batch(name) if batch is None else batch
    compiled = fxpar.compile(make(), plan, example_kwargs=batch, optimizer=adamw, timeout=120,
                             max_grad_norm=MAX_NORM)
    reference = make()
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    adapters = [p for p in reference.parameters() if p.requires_grad]
    opt = adamw(adapters)
    losses, norms, out = [], [], {}
    for i in range(steps):
        with ReduceTap() as tap:
            loss = compiled.step(**batch)
        if i == 0:
            held = [p for s in compiled.pipeline.stages_of(compiled.pp_rank) for p in s.gm.parameters()]
            groups = compiled.optimizer.param_groups if compiled.optimizer else []  # None: no adapter on this rank
            out = {"reduced": tap.bytes, "frozen_grads": sum(p.grad is not None for p in held if not p.requires_grad),
                   "frozen_held": sum(p.numel() for p in held if not p.requires_grad),
                   "states": sum(t.numel() for g in groups for p in g["params"]
                                 for k, t in compiled.optimizer.state.get(p, {}).items() if k == "exp_avg"),
                   "frozen_stepped": sum(not p.requires_grad for g in groups for p in g["params"])}
        opt.zero_grad()
        ref = reference(**batch).loss
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(adapters, MAX_NORM).item()
        opt.step()
        losses.append(abs(loss.item() - ref.item()))
        norms.append((compiled.last_grad_norm, norm))
    state, want = compiled.full_state_dict(), reference.state_dict()
    trainable = {n for n, p in reference.named_parameters() if p.requires_grad}
    return {**out, "loss": max(losses), "norms": norms, "keys": sorted(set(want) ^ set(state)),
            "adapters": max((state[k] - want[k]).abs().max().item() for k in trainable),
            "moved": min((want[k] - start[k]).abs().max().item() for k in trainable),
            "base": sorted(k for k in want if k not in trainable and not torch.equal(state[k], start[k]))}


def _check(results):
    for r in results:
        assert r["keys"] == [] and r["base"] == [], r  # PEFT's names, every base weight bit-unchanged
        assert r["loss"] <= TOL and r["adapters"] <= TOL, r
        # the clipped norm is the adapters' gradients' (each entry once), as clip_grad_norm_ over them, and clips
        assert all(abs(got - want) <= TOL * want and want > 2 * MAX_NORM for got, want in r["norms"]), r
        assert r["moved"] > 1e-3, r  # every adapter tensor really trained
        assert r["frozen_grads"] == 0 and r["frozen_stepped"] == 0, r  # no gradient, not in the optimizer


def test_lora_trains_as_peft_on_one_process():
    _check([lora_training("dp=1")])


def test_export_hf_refuses_a_wrapped_model_export_adapter_writes_it(tmp_path):
    """The Python API: export_hf refuses a PEFT model before writing anything and names export_adapter, which
    writes what PeftModel.from_pretrained loads (the same logits as the compiled model)."""
    from peft import PeftModel

    from fxpar.adapters import export_adapter

    compiled = fxpar.compile(lora_llama(), "dp=1", example_kwargs=_batch(), optimizer=adamw)
    with pytest.raises(PlanError, match=r"LlamaForCausalLM is wrapped \(PEFT, under 'base_model.model.'\).*"
                                        r"fxpar.adapters.export_adapter"):
        checkpoint.export_hf(compiled, tmp_path)
    assert not any(tmp_path.iterdir())  # refused before writing anything
    export_adapter(compiled, tmp_path)
    ids = _batch()["input_ids"]
    loaded = PeftModel.from_pretrained(zoo.build(NAME, seed=0), tmp_path).eval()(input_ids=ids).logits
    assert (loaded - compiled(input_ids=ids).logits).abs().max() <= TOL


@pytest.mark.parametrize("plan,name,variant", [("pp=2", "llama", "lora"), ("tp=2", "llama", "lora"),
                                                ("pp=2", "gpt2", "lora"), ("tp=2", "llama", "dora"),
                                                ("tp=2", "llama", "rslora")])
def test_lora_trains_as_peft_on_two_ranks(pool2, plan, name, variant):
    """DoRA's magnitude vector is trained too: its weight norm reads the base weight, cut by tp on the row
    layers' input features."""
    _check(pool2.run(lora_training, plan, name, variant, timeout=300))


def full_finetune_refused(plan: str, name: str) -> str:
    """The error compiling the plain ``name`` (every weight trainable) under ``plan`` raises, "" if none."""
    try:
        fxpar.compile(zoo.build(name, seed=0), plan, example_kwargs=_batch(name), optimizer=adamw, timeout=120)
    except PlanError as e:
        return str(e)
    return ""


def test_zero3_still_refuses_a_trainable_tie_across_stages(pool4):
    for message in pool4.run(full_finetune_refused, "dp=2,pp=2,zero=3", "gpt2", timeout=300):
        assert "tied across pipeline ranks (['transformer.wte.weight']) would drift apart" in message, message


@pytest.mark.parametrize("plan,name", [("dp=2,tp=2,zero=3", "llama"), ("dp=2,pp=2,zero=3", "gpt2")])
def test_lora_trains_as_peft_on_four_ranks_zero3(pool4, plan, name):
    """ZeRO-3 shards of TP shards (the frozen base cut by tp, then by dp; the adapters as their layers); ZeRO-3
    with a frozen tied embedding on both pipeline stages (allowed: frozen copies cannot drift apart)."""
    _check(pool4.run(lora_training, plan, name, timeout=300))


@pytest.mark.parametrize("plan", ["dp=2", "dp=2,zero=1", "dp=2,zero=3"])
def test_frozen_parameters_are_not_reduced_nor_stepped(pool2, plan):
    results = pool2.run(lora_training, plan, timeout=300)
    _check(results)
    ref = lora_llama()
    adapters = sum(p.numel() for p in ref.parameters() if p.requires_grad)  # an even count: dp divides them
    for r in results:
        # the adapters' fp32 gradients once (all-reduced, or reduce-scattered whole), plus two scalars: the step's
        # loss (fp32) and the clipping's sum of squares (fp64)
        assert r["reduced"] == adapters * 4 + 4 + 8, (r["reduced"], adapters)
        # AdamW's moments for the adapters only: whole under DDP, this rank's half under ZeRO
        assert r["states"] == adapters // (2 if "zero" in plan else 1), (r["states"], adapters)
        # the frozen base held whole under DDP and ZeRO-1, half of it (its shard, padded) under ZeRO-3
        base = sum(p.numel() for p in ref.parameters() if not p.requires_grad)
        if "zero=3" in plan:
            assert base // 2 <= r["frozen_held"] <= base // 2 + 8, (r["frozen_held"], base)
        else:
            assert r["frozen_held"] == base, (r["frozen_held"], base)


def _events(model) -> list[tuple]:
    """(op, module without PEFT's prefix, forward collective, backward collective, their bytes) of every fxpar
    op rank 0 of tp=2 runs, in graph order."""
    priced = fxpar.api.price(model, "tp=2", example_kwargs=_batch())
    return [(e["kind"], e["module"].removeprefix("base_model.model."), e["forward"], e["backward"],
             e["forward_bytes"], e["backward_bytes"])
            for s in priced.pipeline.stages for e in comm.collective_events(s.gm)]


def test_tp_cuts_adapters_with_their_layers_and_adds_one_small_collective_each():
    """Under tp=2 each adapter is cut as its layer: a column-parallel layer's A whole and B by output features,
    a row-parallel layer's A by input features and B whole. Each adapted layer then adds exactly one collective,
    an all-reduce of its r-wide activation (batch x seq x r): the column layer's in backward (A's gradient
    needs the summed gradient of its output), the row layer's in forward (B's input is A's partial sum); no
    collective of the hidden width is added, and every one the model has without adapters is still there once."""
    priced = fxpar.api.price(lora_llama(), "tp=2", example_kwargs=_batch())
    cut = {k.removeprefix("base_model.model.model.layers.0."): d for k, d in priced.result.tp.sharded.items()
           if k.startswith("base_model.model.model.layers.0.")}
    for layer in COLUMN + ROW:
        col = layer in COLUMN
        assert cut.get(_module(layer) + ".base_layer.weight") == (0 if col else 1), cut
        assert cut.get(_module(layer) + ".lora_A.default.weight") == (None if col else 1), cut
        assert cut.get(_module(layer) + ".lora_B.default.weight") == (0 if col else None), cut
    plain, lora = _events(zoo.build(NAME, seed=0)), _events(lora_llama())
    small = R * 4 * 8 * 4  # batch x seq x r, fp32
    added = [e for e in lora if ".lora_A." in e[1]]
    kept = [e for e in lora if ".lora_A." not in e[1]]
    assert [(e[0], *e[2:]) for e in kept] == [(e[0], *e[2:]) for e in plain], (kept, plain)
    layers = zoo.tiny_config(NAME).num_hidden_layers
    assert len(added) == layers * len(COLUMN + ROW), added
    for op, module, fwd, bwd, fwd_bytes, bwd_bytes in added:
        if any(f".{m}." in module for m in COLUMN):
            assert (fwd, bwd, fwd_bytes, bwd_bytes) == (None, "all_reduce", 0, small), module
        else:
            assert (fwd, bwd, fwd_bytes, bwd_bytes) == ("all_reduce", None, small, 0), module


def _module(layer: str) -> str:
    return f"self_attn.{layer}" if layer in ("q_proj", "k_proj", "v_proj", "o_proj") else f"mlp.{layer}"


# ---- fxpar train --lora: export, merge, resume under another plan -------------------------------------------

LORA_ARGS = ["--lora", "r=4", "--lora-alpha", "16", "--lora-targets", "q_proj,o_proj", "--seq", "16",
             "--batch", "4", "--lr", "2e-2", "--weight-decay", "0.1", "--max-grad-norm", "1.0"]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from fxpar.testing.hfdir import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("chat"), "llama")


def lora_run(model_dir: str, out: str, plan: str, steps: int, extra: list[str]) -> dict:
    """``fxpar train MODEL_DIR --lora ...`` on the chat file under ``plan`` for ``steps`` steps, then (every rank)
    the adapters only again into ``out/adapter_only`` (``export_adapter``, gathering only them). Returns the
    compiled model's logits on a fixed batch, its adapters (full) and the losses."""
    from fxpar.adapters import export_adapter, trainable_names
    from fxpar.testing.hfdir import CHAT_FILE
    from fxpar.train.config import FineTuneConfig
    from fxpar.train.loop import FineTune

    args = __import__("argparse").ArgumentParser()
    __import__("fxpar.cli.train", fromlist=["add_arguments"]).add_arguments(args)
    run = FineTune(FineTuneConfig.from_args(args.parse_args(
        [model_dir, "--plan", plan, "--data", str(CHAT_FILE), "--steps", str(steps), *LORA_ARGS, *extra])))
    losses = run.run()
    export_adapter(run.compiled, f"{out}/adapter_only")
    ids = torch.arange(24).reshape(2, 12) % run.model.config.vocab_size + 5
    names = set(trainable_names(run.model))
    return {"logits": run.compiled(input_ids=ids).logits, "ids": ids, "losses": losses, "start": run.start,
            "adapters": run.compiled.full_state_dict(names=names)}


def _peft_logits(model_dir, adapter, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    plain = base(input_ids=ids).logits
    return PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits, plain


@pytest.fixture(scope="module")
def lora_trained(pool2, chat_dir, tmp_path_factory):
    """4 LoRA steps under tp=2 (checkpoints at 2 and 4), exported with --merge."""
    out = tmp_path_factory.mktemp("lora_out")
    extra = ["--save", str(out / "ckpt"), "--save-every", "2", "--export", str(out / "merged"), "--merge"]
    return out, pool2.run(lora_run, str(chat_dir), str(out), "tp=2", 4, extra, timeout=300)[0]


def test_train_lora_exports_what_peft_and_from_pretrained_load(chat_dir, lora_trained):
    """The adapter (in DIR/adapter with --merge, and alone) loads with PeftModel.from_pretrained and the merged
    model with from_pretrained: their logits are the compiled tp=2 model's."""
    from transformers import AutoModelForCausalLM

    out, r = lora_trained
    assert r["losses"][-1] < r["losses"][0], r["losses"]
    for adapter in (out / "merged" / "adapter", out / "adapter_only"):
        assert {p.name for p in adapter.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
        logits, plain = _peft_logits(chat_dir, adapter, r["ids"])
        assert (logits - r["logits"]).abs().max() <= TOL
        assert (plain - r["logits"]).abs().max() > 100 * TOL  # the adapters changed the model
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    assert (merged(input_ids=r["ids"]).logits - r["logits"]).abs().max() <= TOL


def test_train_lora_resumes_under_another_plan(pool2, chat_dir, lora_trained, tmp_path):
    """Resumed under pp=2 from the tp=2 run's step-2 checkpoint: the adapters and their AdamW states are restored
    (steps 3 and 4 give the uninterrupted losses and adapters; fresh moments would not); the adapter exported
    from the two stages loads in PEFT with the compiled model's logits."""
    out, whole = lora_trained
    (out / "ckpt" / "latest").write_text("step_00000002\n")
    r = pool2.run(lora_run, str(chat_dir), str(tmp_path), "pp=2", 4, ["--resume", str(out / "ckpt")],
                  timeout=300)[0]
    print(f"resumed under pp=2, steps 3-4: {r['losses']}; uninterrupted tp=2: {whole['losses'][2:]}")
    assert r["start"] == 2 and len(r["losses"]) == 2
    assert max(abs(a - b) for a, b in zip(r["losses"], whole["losses"][2:])) <= TOL, (r["losses"], whole["losses"])
    assert set(r["adapters"]) == set(whole["adapters"])
    assert max((r["adapters"][k] - whole["adapters"][k]).abs().max().item() for k in r["adapters"]) <= TOL
    logits, _ = _peft_logits(chat_dir, tmp_path / "adapter_only", r["ids"])  # exported from the pp=2 stages
    assert (logits - r["logits"]).abs().max() <= TOL


def test_adapters_of_a_meta_built_model_start_as_peft_makes_them(chat_dir):
    """A PEFT model around a meta-built model: materialize gives PEFT's first values (A drawn, B zero: the model
    starts as the base) and leaves the model on meta; AdapterWeights reads them and the frozen base from the
    directory under PEFT's names, whole (read_shard) and as ZeRO-3's flat boxes of a TP shard (read_boxes)."""
    from peft import get_peft_model
    from safetensors.torch import load_file

    from fxpar.adapters import AdapterWeights, materialize
    from fxpar.ir.placement import ShardLayout
    from fxpar.train.models import load_model
    from fxpar.weights import flat_views

    model = get_peft_model(load_model(str(chat_dir)), LoraConfig(r=R, target_modules=COLUMN))
    first = materialize(model)
    assert all(p.is_meta for p in model.parameters())
    a, b = (f"base_model.model.model.layers.1.self_attn.q_proj.lora_{x}.default.weight" for x in "AB")
    assert set(first) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert first[a].abs().min() > 0 and not first[b].any()
    source = AdapterWeights(model, chat_dir, first)
    base = {k: v for f in chat_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    q = base["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(source.read_shard(a.replace("lora_A.default", "base_layer"), None, 0), q)
    assert torch.equal(source.read_shard(a, None, 0), first[a])
    layout = ShardLayout(dim=0, parts=2)  # rank 1's rows, entries 10..300 of its flattening
    out = torch.empty(290)
    assert source.read_boxes(a.replace("lora_A.default", "base_layer"), tuple(q.shape),
                             flat_views(out, (q.shape[0] // 2, q.shape[1]), 10, 300, layout, 1))
    assert torch.equal(out, q[q.shape[0] // 2:].flatten()[10:300])
    assert source.read_shard("base_model.model.model.rotary_emb.inv_freq", None, 0) is None  # left to the init


def test_a_lora_checkpoint_resumes_only_with_its_adapters(chat_dir, lora_trained):
    """Resuming the tp=2 LoRA run's checkpoint without --lora, or with other targets, is an error before any
    communication (the tensors it lacks would be drawn from the initialiser)."""
    from fxpar.train.loop import FineTune

    out, _ = lora_trained
    common = dict(model=str(chat_dir), data="synthetic", steps=4, resume=str(out / "ckpt"))
    with pytest.raises(PlanError, match="(?s)is a LoRA run's checkpoint .*resume it with --lora"):
        FineTune(**common)
    with pytest.raises(PlanError, match=r"(?s)holds no .*k_proj.lora_A.* saved by a run with other --lora-targets"):
        FineTune(**common, lora="r=4", lora_targets="k_proj")
