"""The models and plans of ``bench/planner_accuracy.py``: six small causal LMs of different shapes, built on the
meta device from hand-written configs, and the plans each one is measured under.

* ``llama``: a Llama, many thin layers (hidden 256, 8 layers, 8 heads / 4 key-value heads, vocab 4096);
* ``gpt2``: a GPT-2 (fused q/k/v in ``Conv1D``, learned positions, tied embeddings), 4 layers of 256;
* ``wide``: a Qwen2 with few, wide layers and a large vocabulary (hidden 192, MLP 2048, 2 layers, vocab 16384):
  embedding and head dominate its parameters, the MLP its FLOPs;
* ``moe``: a Mixtral (4 experts, top-2 routing, grouped-query attention), 4 layers of 128: expert parallelism;
* ``swa``: a Gemma-2 with alternating sliding-window (32 tokens) and full attention layers (``layer_types``),
  grouped-query attention, soft-capped logits, 4 layers of 192 with a vocabulary (4001) and MLP width (690)
  that tp=2 and tp=4 do not divide (uneven shards);
* ``tied``: a Gemma with tied input and output embeddings, 8 layers of 128 (pipelined over 4 ranks, the tied
  weight lives on the first and the last stage).

Every model trains on the same global batch shape (8 sequences of 128 tokens), fp32, AdamW. The plans keep most
runs at 1-4 ranks (the host has 2 cores; 8 ranks share them) and hold at least 4 plans per model at one world
size, so the planner's first choice can be set against the measured fastest.
"""

from __future__ import annotations

import torch
import transformers

BATCH, SEQ = 8, 128

CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False)),
    "gpt2": (transformers.GPT2Config, dict(
        vocab_size=4096, n_embd=256, n_layer=4, n_head=4, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)),
    "wide": (transformers.Qwen2Config, dict(
        vocab_size=16384, hidden_size=192, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)),
    "moe": (transformers.MixtralConfig, dict(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
        attention_dropout=0.0, max_position_embeddings=512, tie_word_embeddings=False)),
    "swa": (transformers.Gemma2Config, dict(
        vocab_size=4001, hidden_size=192, intermediate_size=690, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, query_pre_attn_scalar=48, sliding_window=32,
        layer_types=["sliding_attention", "full_attention"] * 2, attention_dropout=0.0,
        max_position_embeddings=512, tie_word_embeddings=False)),
    "tied": (transformers.GemmaConfig, dict(
        vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, attention_dropout=0.0, max_position_embeddings=512,
        tie_word_embeddings=True)),
}

# (model, plan text); grouped by world size when run. "Checked" groups: 4+ plans per model at one world size.
PLANS = [
    # one rank: the compute-only baselines, and recompute
    ("llama", "dp=1"),
    ("llama", "dp=1,recompute=layer"),
    ("gpt2", "dp=1"),
    ("wide", "dp=1"),
    # two ranks, every model: data, tensor and pipeline parallelism side by side
    ("llama", "dp=2"),
    ("llama", "dp=2,zero=1"),
    ("llama", "dp=2,zero=3"),
    ("llama", "tp=2"),
    ("llama", "pp=2,microbatches=4,schedule=1f1b"),
    ("llama", "pp=2,microbatches=4,schedule=gpipe"),
    ("gpt2", "dp=2"),
    ("gpt2", "dp=2,zero=2"),
    ("gpt2", "tp=2"),
    ("gpt2", "pp=2,microbatches=4"),
    ("wide", "dp=2"),
    ("wide", "dp=2,zero=3"),
    ("wide", "tp=2"),
    ("wide", "tp=2,sequence_parallel=True"),
    ("wide", "pp=2,microbatches=2"),
    # four ranks
    ("llama", "dp=4"),
    ("llama", "dp=2,tp=2"),
    ("llama", "dp=2,pp=2,microbatches=2"),
    ("llama", "tp=4"),
    ("llama", "pp=4,microbatches=8,schedule=1f1b"),
    ("gpt2", "dp=2,tp=2,zero=1"),
    # eight ranks (sharing 2 cores)
    ("llama", "dp=2,pp=2,tp=2,microbatches=2"),
    ("llama", "dp=8,zero=3"),
    # models the cost model was developed without: expert parallelism, sliding windows, tied weights at pp=4,
    # and plans with HSDP, uneven shards (swa's vocabulary and MLP width at tp=2 and tp=4) and recompute
    ("moe", "dp=1"),
    ("moe", "dp=2"),
    ("moe", "ep=2"),
    ("moe", "ep=2,zero=1"),
    ("moe", "ep=2,recompute=layer"),
    ("moe", "dp=2,ep=2"),
    ("moe", "pp=2,ep=2,microbatches=2"),
    ("swa", "dp=1"),
    ("swa", "dp=2,recompute=selective"),
    ("swa", "tp=2"),
    ("swa", "pp=2,microbatches=4,schedule=zbv,virtual_stages=2"),
    ("swa", "tp=4"),
    ("swa", "dp=4,zero=3,dp_replicate=2"),
    ("swa", "dp=2,tp=2,recompute=selective"),
    ("tied", "dp=1"),
    ("tied", "dp=2"),
    ("tied", "pp=2,microbatches=4"),
    ("tied", "pp=4,microbatches=4"),
    ("tied", "pp=4,microbatches=8,schedule=1f1b,recompute=layer"),
    ("tied", "dp=2,pp=2,microbatches=2"),
    ("llama", "dp=4,zero=3,dp_replicate=2"),
    ("llama", "tp=2,recompute=selective"),
    ("wide", "dp=4,zero=2,dp_replicate=2"),
    ("swa", "dp=4,tp=2"),
]

QUICK = [("llama", "dp=1"), ("llama", "dp=2"), ("llama", "tp=2"), ("llama", "pp=2,microbatches=4,schedule=1f1b")]


def config(name: str) -> transformers.PretrainedConfig:
    cls, kw = CONFIGS[name]
    return cls(**kw)


def build_meta(name: str) -> torch.nn.Module:
    """The model on the meta device: no storage; ``fxpar.compile(..., weights="init")`` makes each rank's part."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(name))
    return model.train()


def build_for_compile(name: str) -> tuple[torch.nn.Module, dict]:
    """(model, the ``fxpar.compile`` keywords for its weights): on the meta device with ``weights="init"``, except
    a mixture of experts (a config with experts): expert parallelism cuts its slices from a materialised model,
    and a trace on the meta device takes the experts' grouped path, whose int histogram the CPU lacks; it is
    built on the CPU from seed 0 (every rank the same weights)."""
    cfg = config(name)
    if any(getattr(cfg, k, 0) and getattr(cfg, k) > 1 for k in ("num_local_experts", "num_experts")):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).train(), {}
    return build_meta(name), {"weights": "init"}


def batch(name: str, batch_size: int = BATCH, seq: int = SEQ) -> dict:
    ids = torch.randint(0, config(name).vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)
