"""A zoo of tiny, download-free Hugging Face models for tests, examples and benchmarks.

Every model here is built with ``from_config`` from a small hand-written config, so nothing is ever
fetched from the model hub and a model builds in well under a second on a CPU. The zoo exists so that
fxpar's frontend (tracing / export), its IR, its cost model and its parallelisation passes can be run
against the real modelling code of many architectures -- with the quirks each one brings (GQA, MoE
routing, ALiBi, parallel residuals, soft-capping, relative position buckets, tied embeddings,
encoder-decoder cross-attention...) -- at a size where a full forward + backward takes milliseconds.

Architectures (``ZOO_NAMES``): gpt2, llama, mistral, qwen2, qwen3, gemma, gemma2, phi, phi3, opt,
gpt_neox, falcon, bloom, mixtral, qwen2_moe, olmo (decoder-only causal LMs, ``CAUSAL_LM_NAMES``), bert
(masked LM), t5 and bart (encoder-decoder seq2seq LMs).

Config rules (applied by :func:`tiny_config`; any field can be overridden by keyword):

* hidden size 64 (T5/BART ``d_model`` 64), 4 attention heads, so head_dim 16; ``head_dim`` (and
  Gemma2's ``query_pre_attn_scalar``) are recomputed from the final hidden size / head count unless
  overridden themselves;
* 2 layers; encoder-decoders get 2 encoder + 2 decoder layers;
* grouped-query attention with 2 KV heads wherever the architecture supports it (llama, mistral,
  qwen2, qwen3, gemma, gemma2, phi, phi3, mixtral, qwen2_moe, olmo, and falcon through its
  ``new_decoder_architecture`` -- the Falcon-40B/180B layout); plain multi-head attention elsewhere;
* intermediate (MLP / FFN) size 128 -- for qwen2_moe the routed experts and the shared expert too;
  BLOOM has no such field and keeps its fixed 4 * hidden;
* vocabulary 256; maximum positions 64 where the model has learned or bounded positions (T5 and BLOOM
  have none: relative buckets / ALiBi);
* sliding-window attention (mistral; gemma2's alternate layers) with a window of 4 tokens, shorter
  than the default example sequence, so the window mask really differs from a causal one (with the
  architectures' own 4096-token windows, tiny mistral would compute exactly what tiny llama does);
* MoE: mixtral and qwen2_moe have 4 experts, top-2 routing; qwen2_moe also has its gated shared
  expert; router jitter is 0;
* every dropout-like probability the config has (attention, hidden, residual, embedding, activation,
  classifier, layer-drop...) is 0.0, so a model in ``train()`` mode is deterministic and a train-mode
  run can be compared bitwise with a transformed one;
* ``tie_word_embeddings`` keeps each architecture's default (gpt2, gemma, gemma2, opt, falcon, bloom,
  bert, t5 and bart tie; llama and the others do not); pass ``tie_word_embeddings=True`` (e.g.
  ``build("llama", tie_word_embeddings=True)``) to get a tied variant;
* special token ids (bos / eos / pad / decoder start) are kept within the vocabulary;
* ``use_cache`` is False in the config (and :func:`example_inputs` passes ``use_cache=False`` too):
  the zoo is for training graphs, not for generation. ``stock=True`` (:func:`tiny_config`, :func:`build`,
  :func:`example_inputs`) leaves ``use_cache`` at the transformers default, as ``from_pretrained`` gives
  it (True), and passes no ``use_cache``: the call a user of a stock checkpoint makes.

The field names are the real ones of each ``transformers.<Arch>Config``; the configs are written for
transformers 5.x and stay valid for 4.47 (the only 5.x-era field passed, ``head_dim``, is accepted as a
plain attribute there). Qwen3 does not exist in 4.47: there :func:`is_available` says False and
:func:`tiny_config` / :func:`build` raise; ``ZOO_NAMES`` stays the same in every version.

:func:`example_inputs` returns the keyword arguments for ``model(**kw)``: ``input_ids`` with ids drawn
uniformly from the vocabulary (all ids in range, the pad id excluded so that no model warns about
padding without an attention mask), the ``labels`` that make the model compute its loss (causal LMs:
the input ids -- the model shifts them; BERT: the input ids at every position; T5 / BART: a target
sequence, plus the ``decoder_input_ids`` the model would derive from it, so the shift is not in the
traced graph), and ``use_cache=False`` (none with ``stock=True``). Inputs are deterministic in ``seed`` and use a
private generator, so the global RNG is untouched.

Known caveats (transformers 5.23 / torch 2.13 unless said otherwise):

* mixtral / qwen2_moe store their routed experts as stacked ``[num_experts, ...]`` parameters (5.x; the
  "grouped_mm" experts implementation on CPU); with ``seed=0`` and the default ``(2, 8)`` inputs every
  expert of every layer receives tokens, so every parameter gets a non-zero gradient. Other inputs can
  leave an expert unrouted: its slice of the gradient is then zero (5.x) or, with 4.x's per-expert
  ``nn.ModuleList``, its parameters get no ``.grad`` at all;
* gemma2 uses eager attention (transformers refuses sdpa for it); the others default to sdpa, BLOOM to
  its own eager ALiBi attention; ``build(..., attn_implementation="eager")`` picks explicitly;
* BERT's forward takes no ``use_cache``; GPT2LMHeadModel gets ``loss_type = "ForCausalLM"`` set on it
  (the value transformers 5 falls back to anyway) to silence a per-process warning;
* in transformers 4.x, OPT and BART in ``train()`` mode draw ``torch.rand([])`` per layer for LayerDrop
  even when the probability is 0.0 (so they consume the global RNG, and ``torch.export`` fails there on
  the data-dependent ``if rand < layerdrop``); 5.x skips the draw when the probability is 0.0.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers

__all__ = [
    "ZOO_NAMES",
    "CAUSAL_LM_NAMES",
    "MASKED_LM_NAMES",
    "SEQ2SEQ_LM_NAMES",
    "tiny_config",
    "build",
    "example_inputs",
    "model_kind",
    "is_available",
    "model_class",
    "num_layers",
]

HIDDEN = 64
HEADS = 4
KV_HEADS = 2
LAYERS = 2
INTERMEDIATE = 128
VOCAB = 256
MAX_POSITIONS = 64
EXPERTS = 4
TOP_K = 2
SLIDING_WINDOW = 4  # mistral / gemma2: shorter than the default seq of 8, so the window really masks

_DECODER = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=INTERMEDIATE, vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS)
_GQA = dict(_DECODER, num_key_value_heads=KV_HEADS)

# name -> (config class name, kind, config kwargs). Callables in the kwargs are evaluated on the merged
# kwargs (defaults + overrides), so derived fields follow overrides of the fields they derive from.
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2Config", "causal_lm", dict(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE, vocab_size=VOCAB,
        n_positions=MAX_POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0,
        # GPT-2's <|endoftext|> is the last id; keep it that way inside the tiny vocabulary.
        bos_token_id=lambda kw: kw["vocab_size"] - 1, eos_token_id=lambda kw: kw["vocab_size"] - 1)),
    "llama": ("LlamaConfig", "causal_lm", dict(_GQA, attention_dropout=0.0)),
    "mistral": ("MistralConfig", "causal_lm", dict(_GQA, attention_dropout=0.0, sliding_window=SLIDING_WINDOW)),
    "qwen2": ("Qwen2Config", "causal_lm", dict(_GQA, attention_dropout=0.0)),
    "qwen3": ("Qwen3Config", "causal_lm", dict(_GQA, attention_dropout=0.0)),
    "gemma": ("GemmaConfig", "causal_lm", dict(_GQA, attention_dropout=0.0)),
    "gemma2": ("Gemma2Config", "causal_lm", dict(
        _GQA, attention_dropout=0.0, sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=lambda kw: kw["head_dim"])),
    "phi": ("PhiConfig", "causal_lm", dict(
        _GQA, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "phi3": ("Phi3Config", "causal_lm", dict(
        _GQA, attention_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        original_max_position_embeddings=lambda kw: kw["max_position_embeddings"],
        # Phi-3's pad / eos (32000) lie beyond the tiny vocabulary; the embedding's padding_idx is the pad id.
        bos_token_id=1, eos_token_id=lambda kw: kw["vocab_size"] - 1,
        pad_token_id=lambda kw: kw["vocab_size"] - 1)),
    "opt": ("OPTConfig", "causal_lm", dict(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=INTERMEDIATE,
        word_embed_proj_dim=lambda kw: kw["hidden_size"], vocab_size=VOCAB,
        max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0, layerdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", "causal_lm", dict(
        _DECODER, attention_dropout=0.0, hidden_dropout=0.0, classifier_dropout=0.0)),
    "falcon": ("FalconConfig", "causal_lm", dict(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        new_decoder_architecture=True, num_kv_heads=KV_HEADS, ffn_hidden_size=INTERMEDIATE,
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, attention_dropout=0.0,
        hidden_dropout=0.0, bos_token_id=11, eos_token_id=11)),
    "bloom": ("BloomConfig", "causal_lm", dict(
        hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB,
        attention_dropout=0.0, hidden_dropout=0.0)),
    "mixtral": ("MixtralConfig", "causal_lm", dict(
        _GQA, attention_dropout=0.0, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        router_jitter_noise=0.0)),
    "qwen2_moe": ("Qwen2MoeConfig", "causal_lm", dict(
        _GQA, attention_dropout=0.0, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTERMEDIATE, shared_expert_intermediate_size=INTERMEDIATE,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "olmo": ("OlmoConfig", "causal_lm", dict(
        _GQA, attention_dropout=0.0, eos_token_id=lambda kw: kw["vocab_size"] - 1)),
    "bert": ("BertConfig", "masked_lm", dict(
        _DECODER, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)),
    "t5": ("T5Config", "seq2seq_lm", dict(
        d_model=HIDDEN, d_kv=lambda kw: kw["d_model"] // kw["num_heads"], d_ff=INTERMEDIATE,
        num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS, vocab_size=VOCAB,
        dropout_rate=0.0, classifier_dropout=0.0, decoder_start_token_id=0)),
    "bart": ("BartConfig", "seq2seq_lm", dict(
        d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE,
        vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, classifier_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)),
}

# Architectures whose attention takes an explicit head_dim (derived from hidden_size / heads here).
_HEAD_DIM = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral",
                       "qwen2_moe", "olmo"})

ZOO_NAMES: tuple[str, ...] = tuple(sorted(_SPECS))
CAUSAL_LM_NAMES: tuple[str, ...] = tuple(n for n in ZOO_NAMES if _SPECS[n][1] == "causal_lm")
MASKED_LM_NAMES: tuple[str, ...] = tuple(n for n in ZOO_NAMES if _SPECS[n][1] == "masked_lm")
SEQ2SEQ_LM_NAMES: tuple[str, ...] = tuple(n for n in ZOO_NAMES if _SPECS[n][1] == "seq2seq_lm")

_AUTO = {
    "causal_lm": "AutoModelForCausalLM",
    "masked_lm": "AutoModelForMaskedLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
}

_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
                "sep_token_id", "forced_bos_token_id", "forced_eos_token_id")


def _spec(name: str) -> tuple[str, str, dict[str, Any]]:
    try:
        return _SPECS[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO_NAMES)}") from None


def model_kind(name: str) -> str:
    """``"causal_lm"``, ``"masked_lm"`` or ``"seq2seq_lm"``."""
    return _spec(name)[1]


def _config_class(name: str) -> type:
    cls_name = _spec(name)[0]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise RuntimeError(f"zoo model {name!r} needs transformers.{cls_name}, which transformers "
                           f"{transformers.__version__} does not have")
    return cls


def is_available(name: str) -> bool:
    """Whether the installed transformers has zoo model ``name``'s architecture (qwen3 needs >= 4.51)."""
    return hasattr(transformers, _spec(name)[0])


def _is_dropout_field(key: str) -> bool:
    k = key.lower()
    return "drop" in k and not k.startswith("_")


def tiny_config(name: str, *, stock: bool = False, **overrides: Any) -> transformers.PretrainedConfig:
    """The tiny config of zoo model ``name`` (see the module docstring), with ``overrides`` applied;
    ``stock``: ``use_cache`` keeps the config class's default (True) instead of False.

    Overrides are config field names (``tie_word_embeddings=True``, ``num_hidden_layers=4``,
    ``attn_implementation="eager"`` ...). Derived fields (``head_dim``, Gemma2's ``query_pre_attn_scalar``,
    T5's ``d_kv``, OPT's ``word_embed_proj_dim``, ids tied to the vocabulary size) follow the overridden
    fields unless they are overridden themselves.
    """
    cls = _config_class(name)
    _, _, defaults = _spec(name)
    attn_impl = overrides.pop("attn_implementation", None)
    kw: dict[str, Any] = {k: v for k, v in defaults.items() if not callable(v)}
    kw.update(overrides)
    if name in _HEAD_DIM and "head_dim" not in kw:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    for k, v in defaults.items():
        if callable(v) and k not in overrides:
            kw[k] = v(kw)
    if not stock:
        kw.setdefault("use_cache", False)
    cfg = cls(**kw)
    if not cfg.use_cache and getattr(cfg, "cache_implementation", None) is not None \
            and "cache_implementation" not in overrides:
        # transformers 4.x Gemma2 defaults to cache_implementation="hybrid"; with use_cache=False its
        # generation-config check logs a malformed warning that breaks under pytest's log capture.
        cfg.cache_implementation = None
    # Belt and braces: whatever dropout-like field this config class has that the table did not name
    # (the field set differs between transformers versions) is zeroed too, unless overridden.
    for key, value in list(cfg.to_dict().items()):
        if _is_dropout_field(key) and key not in overrides and not isinstance(value, bool) \
                and (value is None or isinstance(value, (int, float))) and value != 0.0:
            setattr(cfg, key, 0.0)
    vocab = cfg.vocab_size
    for key in _SPECIAL_IDS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not 0 <= value < vocab:
            raise ValueError(f"zoo {name}: {key}={value} outside the vocabulary of {vocab}")
    if attn_impl is not None:
        cfg._attn_implementation = attn_impl
    return cfg


def model_class(name: str, config: transformers.PretrainedConfig | None = None) -> type:
    """The task-head model class ``build(name)`` instantiates (resolved without instantiating)."""
    config = config if config is not None else tiny_config(name)
    auto = getattr(transformers, _AUTO[model_kind(name)])
    return auto._model_mapping[type(config)]


def build(name: str, *, seed: int = 0, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, stock: bool = False, **config_overrides: Any) -> torch.nn.Module:
    """Build zoo model ``name`` with its task head, deterministically in ``seed``, in ``train()`` mode.

    Parameters are initialised in float32 under ``torch.manual_seed(seed)`` (the global RNG state is
    saved and restored, so building does not disturb the caller's RNG) and then cast to ``dtype``, so
    builds with the same seed are bitwise identical whatever the dtype. ``device="meta"`` builds under a
    ``torch.device("meta")`` context and allocates no storage. ``config_overrides`` go to
    :func:`tiny_config`, except ``attn_implementation`` ("eager", "sdpa"...), which goes to
    ``from_config`` (the default is transformers' own choice: sdpa where the architecture has it).
    ``stock``: the config's ``use_cache`` stays at the transformers default (:func:`tiny_config`).
    """
    attn_impl = config_overrides.pop("attn_implementation", None)
    cfg = tiny_config(name, stock=stock, **config_overrides)
    auto = getattr(transformers, _AUTO[model_kind(name)])
    kwargs = {} if attn_impl is None else {"attn_implementation": attn_impl}
    device = torch.device(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        with torch.device(device):
            model = auto.from_config(cfg, **kwargs)
    if dtype != torch.float32:
        model = model.to(dtype=dtype)
    if model_kind(name) == "causal_lm" and getattr(model, "loss_type", "") is None:
        # transformers 5 derives the loss from the class name; GPT2LMHeadModel's does not match and every
        # first call logs "loss_type=None ... unrecognized" before using the causal-LM loss anyway.
        model.loss_type = "ForCausalLM"
    model.train()
    return model


def num_layers(name: str, config: transformers.PretrainedConfig | None = None) -> int | tuple[int, int]:
    """The layer count a config asks for: an int, or ``(encoder, decoder)`` for seq2seq models."""
    cfg = config if config is not None else tiny_config(name)
    if name == "t5":
        return (cfg.num_layers, cfg.num_decoder_layers)
    if name == "bart":
        return (cfg.encoder_layers, cfg.decoder_layers)
    return cfg.num_hidden_layers


def _accepts(cls: type, arg: str) -> bool:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False
    return arg in params


def _random_ids(gen: torch.Generator, vocab: int, shape: tuple[int, ...], exclude: int | None) -> torch.Tensor:
    if exclude is None or not 0 <= exclude < vocab:
        return torch.randint(0, vocab, shape, generator=gen)
    ids = torch.randint(0, vocab - 1, shape, generator=gen)
    return ids + (ids >= exclude).to(ids.dtype)  # uniform over the vocabulary minus the pad id


def example_inputs(name: str, model_or_config: torch.nn.Module | transformers.PretrainedConfig, *,
                   batch: int = 2, seq: int = 8, seed: int = 0, labels: bool = True,
                   device: str | torch.device | None = None, stock: bool = False) -> dict[str, torch.Tensor | bool]:
    """Keyword arguments for ``model(**kw)`` (see the module docstring); ``stock``: no ``use_cache``.

    Tensors are int64 on ``device``; by default the model's device (CPU when given a config; for a meta
    model, meta -- the values are drawn on the CPU either way, so they do not depend on the device).
    """
    if isinstance(model_or_config, torch.nn.Module):
        cfg = model_or_config.config
        cls = type(model_or_config)
        if device is None:
            param = next(model_or_config.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
    else:
        cfg = model_or_config
        cls = model_class(name, cfg)
    device = torch.device("cpu" if device is None else device)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos is not None and seq > max_pos:
        raise ValueError(f"zoo {name}: seq={seq} exceeds max_position_embeddings={max_pos}")
    kind = model_kind(name)
    vocab = cfg.vocab_size
    pad = getattr(cfg, "pad_token_id", None)
    gen = torch.Generator().manual_seed(seed)
    input_ids = _random_ids(gen, vocab, (batch, seq), pad)
    kw: dict[str, torch.Tensor | bool] = {"input_ids": input_ids}
    if kind in ("causal_lm", "masked_lm"):
        if labels:  # causal LMs shift internally; the masked LM predicts every (unmasked) position
            kw["labels"] = input_ids.clone()
    else:  # seq2seq: a target sequence and the decoder inputs the model would shift it into
        target = _random_ids(gen, vocab, (batch, seq), pad)
        start = cfg.decoder_start_token_id
        decoder_input_ids = torch.cat([torch.full((batch, 1), start, dtype=target.dtype), target[:, :-1]], 1)
        kw["decoder_input_ids"] = decoder_input_ids
        if labels:
            kw["labels"] = target
    if device.type != "cpu":
        kw = {k: v.to(device) for k, v in kw.items()}
    if not stock and _accepts(cls, "use_cache"):
        kw["use_cache"] = False
    return kw
