"""The tiny model zoo (fxpar.zoo): every model builds, trains one step, and is reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from fxpar import zoo

REQUIRED = {
    "gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "opt", "gpt_neox",
    "falcon", "bloom", "mixtral", "qwen2_moe", "olmo", "bert", "t5", "bart",
}
GQA = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "mixtral", "qwen2_moe", "olmo"}
MOE = {"mixtral", "qwen2_moe"}
_LAYER_LISTS = {"layers", "h", "layer", "block"}


def _need(name: str) -> None:
    if not zoo.is_available(name):
        pytest.skip(f"transformers has no {name} architecture")


def _layer_lists(model: torch.nn.Module) -> dict[str, int]:
    """The outermost ModuleLists of transformer layers (T5's per-block ``layer`` lists are nested)."""
    found: dict[str, int] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and path.rsplit(".", 1)[-1] in _LAYER_LISTS:
            if not any(path.startswith(outer + ".") for outer in found):
                found[path] = len(mod)
    return found


def _expert_slices(model: torch.nn.Module):
    """(name, per-expert grads) for every routed-expert weight: a stacked [E, ...] parameter
    (transformers 5) or the parameters of a ModuleList of expert MLPs (transformers 4)."""
    for path, mod in model.named_modules():
        if path.rsplit(".", 1)[-1] != "experts":
            continue
        if isinstance(mod, torch.nn.ModuleList):
            for i, expert in enumerate(mod):
                for pname, p in expert.named_parameters():
                    yield f"{path}.{i}.{pname}", [p.grad]
        else:
            for pname, p in mod.named_parameters(recurse=False):
                if p.dim() == 3:
                    yield f"{path}.{pname}", [None if p.grad is None else p.grad[e] for e in range(p.shape[0])]


def test_zoo_names_cover_required():
    assert REQUIRED <= set(zoo.ZOO_NAMES)
    assert list(zoo.ZOO_NAMES) == sorted(zoo.ZOO_NAMES)
    assert set(zoo.CAUSAL_LM_NAMES) == REQUIRED - {"bert", "t5", "bart"}
    assert {zoo.model_kind(n) for n in zoo.ZOO_NAMES} == {"causal_lm", "masked_lm", "seq2seq_lm"}
    assert zoo.model_kind("bert") == "masked_lm"
    assert zoo.model_kind("t5") == zoo.model_kind("bart") == "seq2seq_lm"
    with pytest.raises(KeyError):
        zoo.tiny_config("no_such_model")


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_config_rules(name):
    _need(name)
    cfg = zoo.tiny_config(name)
    assert cfg.vocab_size == 256
    hidden = getattr(cfg, "d_model", None) or cfg.hidden_size
    assert hidden == 64
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "encoder_attention_heads", None) \
        or cfg.num_attention_heads
    assert heads == 4
    if name in GQA:
        assert cfg.num_key_value_heads == 2
    if name == "falcon":
        assert cfg.new_decoder_architecture and cfg.num_kv_heads == 2
    max_pos = getattr(cfg, "max_position_embeddings", None)
    assert max_pos is None or max_pos >= 64
    if name in MOE:
        experts = cfg.num_local_experts if name == "mixtral" else cfg.num_experts
        assert (experts, cfg.num_experts_per_tok) == (4, 2)
    if name == "qwen2_moe":
        assert cfg.shared_expert_intermediate_size > 0
    for key, value in cfg.to_dict().items():
        if "drop" in key.lower() and isinstance(value, float):
            assert value == 0.0, f"{name}: {key}={value}"
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        value = getattr(cfg, key, None)
        assert value is None or 0 <= value < cfg.vocab_size, (key, value)
    # overrides win, derived fields follow them
    assert zoo.tiny_config(name, vocab_size=300).vocab_size == 300


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_train_step_and_reproducibility(name):
    _need(name)
    model = zoo.build(name, seed=0)
    assert model.training
    assert type(model) is zoo.model_class(name)

    # the requested number of layers (2, or 2 + 2 for encoder-decoders)
    lists = _layer_lists(model)
    want = zoo.num_layers(name, model.config)
    assert sorted(lists.values()) == ([2] if isinstance(want, int) else [2, 2]), lists
    assert want == 2 or want == (2, 2)

    # no live dropout anywhere: train mode is deterministic
    for path, mod in model.named_modules():
        if isinstance(mod, torch.nn.modules.dropout._DropoutNd):
            assert mod.p == 0.0, f"{name}: {path} has p={mod.p}"

    kw = zoo.example_inputs(name, model)
    ids = kw["input_ids"]
    assert ids.dtype == torch.int64 and ids.shape == (2, 8)
    assert 0 <= int(ids.min()) and int(ids.max()) < model.config.vocab_size
    assert "labels" in kw
    if zoo.model_kind(name) == "seq2seq_lm":
        assert "decoder_input_ids" in kw
    if name != "bert":
        assert kw.get("use_cache") is False

    out = model(**kw)
    loss = out.loss
    assert loss is not None and loss.dim() == 0 and math.isfinite(loss.item())
    # a random init predicts roughly uniformly over the vocabulary
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 1.5
    loss.backward()

    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"{name}: no grad for {missing}"
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"{name}: non-finite grads in {bad}"
    # MoE: with seed 0 and the default (2, 8) inputs, every expert of every layer gets tokens, so every
    # expert's weights get a non-zero gradient (an unrouted expert would legitimately get none / zero).
    if name in MOE:
        slices = list(_expert_slices(model))
        assert slices, f"{name}: found no expert weights"
        for pname, grads in slices:
            for e, g in enumerate(grads):
                assert g is not None and bool(g.abs().sum() > 0), f"{name}: expert {e} of {pname} unused"

    # same seed -> bitwise identical weights, and (dropout being 0) a bitwise identical train-mode loss
    again = zoo.build(name, seed=0)
    sd0, sd1 = model.state_dict(), again.state_dict()
    assert sd0.keys() == sd1.keys()
    for key in sd0:
        assert torch.equal(sd0[key], sd1[key]), f"{name}: {key} differs between two seed-0 builds"
    kw_again = zoo.example_inputs(name, again)
    assert all(torch.equal(kw[k], kw_again[k]) if torch.is_tensor(kw[k]) else kw[k] == kw_again[k] for k in kw)
    assert torch.equal(again(**kw_again).loss, loss.detach())
    # ... and another seed gives other weights and other inputs
    other = zoo.build(name, seed=1)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), other.parameters()))
    assert not torch.equal(zoo.example_inputs(name, other, seed=1)["input_ids"], ids)


@pytest.mark.parametrize("name", zoo.ZOO_NAMES)
def test_meta_build_allocates_nothing(name):
    _need(name)
    model = zoo.build(name, device="meta")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    assert tensors
    on_other = [n for n, t in tensors if t.device.type != "meta"]
    assert not on_other, f"{name}: not on meta: {on_other}"
    kw = zoo.example_inputs(name, model)
    assert all(v.device.type == "meta" for v in kw.values() if torch.is_tensor(v))
    cpu_kw = zoo.example_inputs(name, model, device="cpu")
    assert torch.equal(cpu_kw["input_ids"], zoo.example_inputs(name, model.config)["input_ids"])


def test_tied_embeddings():
    llama = zoo.build("llama")
    assert llama.lm_head.weight is not llama.get_input_embeddings().weight
    tied = zoo.build("llama", tie_word_embeddings=True)
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    gpt2 = zoo.build("gpt2")  # gpt2 ties by default
    assert gpt2.get_output_embeddings().weight is gpt2.get_input_embeddings().weight


def test_example_inputs_options():
    cfg = zoo.tiny_config("llama")
    kw = zoo.example_inputs("llama", cfg, batch=3, seq=16, seed=5, labels=False)
    assert set(kw) == {"input_ids", "use_cache"} and kw["input_ids"].shape == (3, 16)
    assert torch.equal(kw["input_ids"], zoo.example_inputs("llama", cfg, batch=3, seq=16, seed=5)["input_ids"])
    t5 = zoo.example_inputs("t5", zoo.tiny_config("t5"), labels=False)
    assert set(t5) == {"input_ids", "decoder_input_ids", "use_cache"}
    # the pad id never appears in generated ids
    for name in ("bert", "gemma", "opt", "bart", "phi3"):
        cfg = zoo.tiny_config(name)
        ids = zoo.example_inputs(name, cfg, batch=8, seq=64)["input_ids"]
        assert not (ids == cfg.pad_token_id).any()
    with pytest.raises(ValueError):
        zoo.example_inputs("gpt2", zoo.tiny_config("gpt2"), seq=65)


def test_dtype_and_rng_untouched():
    state = torch.random.get_rng_state()
    model = zoo.build("llama", dtype=torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = zoo.build("llama")
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16))
