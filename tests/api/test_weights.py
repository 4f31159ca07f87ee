"""Meta-device models: each rank materialises only its shards, from a state dict, safetensors files
(read slice by slice) or the model's initialiser; training then matches the full model's."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import save_file

import fxpar
from fxpar import zoo
from fxpar.testing import multiproc
from fxpar.testing.compare import train_against_reference
from fxpar.weights import WeightSource

TOL = 1e-5
pool2 = multiproc.rank_pool(2)
pool4 = multiproc.rank_pool(4)


def _meta(name: str, **overrides) -> torch.nn.Module:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(zoo.tiny_config(name, **overrides))
    return model.train()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def meta_training(name: str, plan: str, source: str, path: str) -> dict:
    ref = zoo.build(name, seed=0)
    weights = {"state_dict": ref.state_dict(), "safetensors": path, "init": "init"}[source]
    batch = zoo.example_inputs(name, ref, batch=4, seq=8)
    compiled = fxpar.compile(_meta(name), plan, example_kwargs=batch, optimizer=sgd, weights=weights, timeout=60)
    held = {n: tuple(p.shape) for n, p in compiled.program.named_parameters() if not p.is_meta}
    meta_left = [n for stage in compiled.pipeline.stages_of(compiled.pp_rank)
                 for n, p in stage.gm.named_parameters() if p.is_meta]
    state = compiled.full_state_dict()
    out = {"held": held, "meta_left": meta_left}
    if source == "init":  # the same values on every plan and rank: each module seeded by its FQN
        expected = WeightSource(_meta(name), "init")
        out["init_diff"] = max((state[k] - expected.load([k], None, like=v)).abs().max().item()
                               for k, v in ref.state_dict().items())
        out["std"] = state["model.layers.0.mlp.up_proj.weight"].std().item()
        return out
    out["weights"] = max((state[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    ref_opt = sgd(ref.parameters())
    loss = compiled.step(**batch)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_opt.step()
    out["loss"] = abs(loss.item() - ref_loss.item())
    return out


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "model.safetensors"
    ref = zoo.build("llama", seed=0)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"
               or not ref.config.tie_word_embeddings}, str(path))
    return str(path)


@pytest.mark.parametrize("source", ["state_dict", "safetensors"])
def test_meta_model_from_weights_tp2(source, llama_file, pool2):
    for rank, r in enumerate(pool2.run(meta_training, "llama", "tp=2", source, llama_file, timeout=120)):
        assert r["weights"] <= TOL and r["loss"] <= TOL, r
        assert not r["meta_left"], r["meta_left"]
        full = dict(zoo.build("llama").named_parameters())
        assert r["held"]["model.layers.0.mlp.up_proj.weight"] == (
            full["model.layers.0.mlp.up_proj.weight"].shape[0] // 2, full["model.layers.0.mlp.up_proj.weight"].shape[1])


def test_meta_model_from_initialiser(pool2):
    for r in pool2.run(meta_training, "llama", "tp=2", "init", "", timeout=120):
        assert r["init_diff"] == 0.0 and not r["meta_left"]
        assert 0.015 < r["std"] < 0.025  # transformers' initializer_range 0.02


def test_meta_model_with_two_stages_per_rank(pool2):
    """Virtual stages: rank 0 runs stages 0 and 2, and both recompute the rotary table from the same
    buffer; the weights loaded for the first stage must reach the second (it ran on meta data before)."""
    plan = "pp=2,schedule=interleaved_1f1b,microbatches=2"
    for r in pool2.run(meta_training, "llama", plan, "state_dict", "", timeout=120):
        assert r["weights"] <= TOL and r["loss"] <= TOL and not r["meta_left"], r


# A vocabulary (251) and MLP width (130) that put the ZeRO-3 shard boundaries inside rows of the embedding,
# the MLP weights and the layer buckets, so a rank's entries of a parameter are several boxes of it.
ODD = dict(vocab_size=251, intermediate_size=130)


def zero3_from_initialiser(name: str, plan: str) -> dict:
    """``plan`` (ZeRO-3) compiled from a meta model with ``weights="init"``, a rank reading only its entries
    of the initialiser's tensors, against one process holding the initialiser's full tensors: the loss and
    every parameter's gradient of two steps, and the parameters after each."""
    source = WeightSource(_meta(name, **ODD), "init")
    reference = zoo.build(name, seed=0, **ODD)
    with torch.no_grad():  # a tied weight once, under its first name (as compile reads it)
        for k, t in [*reference.named_parameters(), *reference.named_buffers()]:
            t.copy_(source.load([k], None, like=t))
    batch = zoo.example_inputs(name, reference, batch=4, seq=8)
    compiled = fxpar.compile(_meta(name, **ODD), plan, example_kwargs=batch, optimizer=sgd, weights="init",
                             timeout=60)
    return train_against_reference(compiled, reference, sgd, batch, 2, grads=True)


@pytest.mark.slow
def test_zero3_meta_model_from_initialiser_with_shards_across_rows(pool2):
    for r in pool2.run(zero3_from_initialiser, "gemma2", "dp=2,zero=3", timeout=120):
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r


def test_initialiser_entries_across_rows_equal_the_whole_tensor():
    """``load_flat`` of the initialiser: entries starting and ending inside rows (several boxes of the
    tensor) equal those entries of the whole tensor ``load`` gives."""
    model = _meta("gemma2", **ODD)
    source = WeightSource(model, "init")
    for name, p in model.named_parameters():
        n = p.numel()
        flat = source.load_flat([name], None, p, 1, n - 1)
        assert not flat.requires_grad and torch.equal(flat, source.load([name], None, like=p).flatten()[1:n - 1]), name


@pytest.mark.slow
def test_meta_model_pp2_tp2_holds_only_its_stages(llama_file, pool4):
    results = pool4.run(meta_training, "llama", "pp=2,tp=2", "safetensors", llama_file, timeout=180)
    for r in results:
        assert r["weights"] <= TOL and r["loss"] <= TOL and not r["meta_left"], r
    first, last = results[0]["held"], results[-1]["held"]
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert "model.norm.weight" in last and "model.norm.weight" not in first


def test_wrong_state_dict_is_a_clear_error():
    model = _meta("llama")
    source = WeightSource(model, {"model.embed_tokens.weight": torch.zeros(3, 3)})
    with pytest.raises(fxpar.PlanError, match=r"model.embed_tokens.weight has shape \(3, 3\)"):
        source.load(["model.embed_tokens.weight"], None, like=torch.empty(256, 64, device="meta"))


def meta_falcon_zero3() -> dict:
    """Falcon built on meta, its weights from a state dict, under dp=2 zero=3, against one process."""
    ref = zoo.build("falcon", seed=0)
    batch = zoo.example_inputs("falcon", ref, batch=4, seq=8)
    weights = {k: v.clone() for k, v in ref.state_dict().items()}
    compiled = fxpar.compile(_meta("falcon"), "dp=2,zero=3", example_kwargs=batch, optimizer=sgd, weights=weights,
                             timeout=60)
    lifted = {k: v.device.type for k, v in compiled.program.constants.items() if isinstance(v, torch.Tensor)}
    return {**train_against_reference(compiled, ref, sgd, batch, 1, grads=True), "lifted": lifted}


def test_constants_a_meta_forward_builds_from_python_data_keep_their_values(pool2):
    """Falcon's qkv[..., [-2]] builds an index tensor from a list on its input's device: traced on meta, it is
    built on the CPU (values kept) and moved, so the meta-built model runs under ZeRO-3 equal to one process
    (it ran with values it never had, loss nan, then was refused)."""
    for r in pool2.run(meta_falcon_zero3, timeout=120):
        assert r["lifted"] and set(r["lifted"].values()) == {"cpu"}, r["lifted"]
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["weights"] <= TOL, r


class _PlainTensorAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.scale = torch.tensor([0.5, 2.0, 1.0, 3.0])  # neither a parameter nor a buffer: no weights= has it

    def forward(self, x):
        return {"loss": (self.proj(x) * self.scale).pow(2).mean()}


def test_a_constant_a_meta_model_never_had_values_for_is_a_clear_error():
    """A tensor attribute of a model built on meta was never written: nothing can recover its values, so
    compile refuses the program before any communication."""
    with torch.device("meta"):
        model = _PlainTensorAttribute()
    weights = {k: torch.zeros(v.shape) for k, v in model.state_dict().items()}
    with pytest.raises(fxpar.PlanError, match=r"(?s)_PlainTensorAttribute traced on the meta device .* builds 1 "
                                              r"constant tensors .*scale.*zero=3"):
        fxpar.compile(model, "dp=1", example_kwargs={"x": torch.ones(2, 4)}, optimizer=sgd, weights=weights)
