"""Tiny configs for ``bench/registry_sweep.py``: each causal-LM architecture's config class shrunk by rules
keyed on config field names (and on what a model's constructor or forward reads), never on model names.

:func:`tiny_config` is the entry point; :func:`shrink` the rule for one config class.
"""

from __future__ import annotations

import dataclasses
import math

# The shrinking rule, on config field names. An int field only shrinks (min(default, cap)).
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB, POSITIONS, EXPERTS, TOP_K = 64, 4, 2, 2, 128, 256, 64, 4, 2
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "num_experts_per_token")
_HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_CAP = {  # exact field names
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "model_dim", "embed_dim", "word_embed_proj_dim",
                     "embedding_size", "d_embed", "hidden_dim"), HIDDEN),
    **dict.fromkeys(("n_inner", "d_ff", "d_inner", "inner_hidden_size"), FFN),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                     "original_max_position_embeddings", "seq_length"), POSITIONS),  # the example seq is 8
    # mixture of experts: 4 experts, top-2, one shared expert, an MoE layer within 2 layers, 2 expert groups
    **dict.fromkeys(_EXPERT_KEYS, EXPERTS), **dict.fromkeys(_TOP_K_KEYS, TOP_K),
    "n_shared_experts": 1, "num_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
    "num_expert_group": 2, "topk_group": 1, "n_groups": 2,  # (SSM state groups divide the 4 heads)
    "qk_nope_head_dim": 16, "v_head_dim": 16,  # latent attention: d_qk = 16 + 8 (rope), d_v = 16
}
_PATTERNS = [  # (predicate on the field name, cap); the first match wins
    (lambda k: "intermediate" in k or "ffn" in k, FFN),
    (lambda k: k.endswith(("attention_heads", "num_heads", "n_head", "n_heads")), HEADS),
    (lambda k: k.endswith(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                           "encoder_layers")), LAYERS),
    (lambda k: k.endswith(("vocab_size", "_vocab")), VOCAB),
    (lambda k: k.startswith("hidden_size"), HIDDEN),  # widths of other parts (e.g. hidden_size_global)
    (lambda k: k.endswith("kv_shared_layers"), 0),  # layers reusing earlier layers' keys/values: none
    (lambda k: k.endswith("lora_rank"), 32),
    (lambda k: "rope" in k and k.endswith("head_dim"), 8),
]


def _rule(key: str, value, cfg: dict, old: dict):
    """The shrunk value of one field (``cfg``: shrunk fields so far, ``old``: the defaults) or ``value``."""
    if "drop" in key.lower() and isinstance(value, float):  # every dropout-like probability
        return 0.0
    if key == "use_cache":
        return False
    if value is None and key in _TOP_K_KEYS and any(k in old for k in _EXPERT_KEYS):  # unset top-k of an MoE
        return TOP_K
    if value is None and key in _EXPERT_KEYS + ("n_shared_experts",) and "moe_intermediate_size" in old:
        return EXPERTS if key in _EXPERT_KEYS else 1  # an MoE whose expert counts default to unset
    if key == "is_decoder":  # a causal LM is a decoder (some heads assert it, others warn)
        return True
    heads = next((cfg[k] for k in _HEADS_KEYS if k in cfg), HEADS)
    if value is None and key == "head_dim" and any(k in old for k in _HEADS_KEYS):
        return _width(cfg) // heads  # unset: some models need it, the others fall back to the same
    if value is None and key == "num_key_value_heads" and any(k in old for k in _HEADS_KEYS):
        return heads  # unset means one key/value head per query head; some models need it set
    if value is None and key == "default_language" and old.get("languages"):
        return old["languages"][0]  # per-language adapters: the forward needs a language when given none
    if value is None and key == "clip_qkv":  # some forwards clamp unconditionally: a bound never reached
        return 1e4
    ints = isinstance(value, (list, tuple)) and value and all(type(v) is int for v in value)
    if ints and "dim" in key and sum(value) == _width(old):  # widths of parts of the hidden size
        parts = [v * _width(cfg) // sum(value) for v in value[:-1]]
        return [*parts, _width(cfg) - sum(parts)]
    if ints and len(value) > 1 and math.prod(value) == old.get("max_position_embeddings"):
        # axial positions: factors of the shrunk position count (the sweep feeds that many tokens)
        n = _rule("max_position_embeddings", math.prod(value), cfg, old)
        side = round(n ** (1 / len(value)))
        return [side] * (len(value) - 1) + [n // side ** (len(value) - 1)]
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    # latent attention: a head_dim equal to the rope dim (or rope + nope) in the defaults stays equal to it
    rope, nope = old.get("qk_rope_head_dim"), old.get("qk_nope_head_dim")
    if key == "head_dim" and isinstance(rope, int) and value in (rope, rope + (nope or 0)):
        return _rule("qk_rope_head_dim", rope, cfg, old) + (value != rope and _rule("qk_nope_head_dim", nope, cfg, old))
    if key in ("head_dim", "attention_head_dim", "kv_channels") or "rotary_dim" in key:
        # the shrunk width over the shrunk heads (SSM heads span expand x the width)
        width = _width(cfg)
        width *= old["expand"] if key == "head_dim" and isinstance(old.get("expand"), int) else 1
        return min(value, max(width // next((cfg[k] for k in _HEADS_KEYS if k in cfg), HEADS), 1))
    if "kv_heads" in key or "key_value_heads" in key or key == "multi_query_group_num":
        # grouped-query (2 key/value heads) only where the defaults group queries
        heads = next((old[k] for k in _HEADS_KEYS if isinstance(old.get(k), int)), None)
        return min(value, KV_HEADS) if heads is not None and value < heads else min(value, HEADS)
    if key in _CAP:
        return min(value, _CAP[key])
    return next((min(value, cap) for pred, cap in _PATTERNS if pred(key)), value)


def _width(cfg: dict) -> int:
    return cfg.get("hidden_size", cfg.get("d_model", cfg.get("n_embd", HIDDEN)))


def shrink(cls, base=None):
    """A tiny instance of config class ``cls`` (from ``base``, default its defaults), field by field:
    * :func:`_rule` on each field (the caps of ``_CAP`` / ``_PATTERNS``, dropout, heads, head dims; a few
      unset fields some constructors or forwards read unguarded: ``head_dim``, ``num_key_value_heads``,
      ``default_language``, ``clip_qkv``; ``is_decoder``; widths and axial factors inside int lists);
    * per-layer lists (types, windows) keep their first entries, as many as the new layer count; layer
      index lists (``*_layers``), ``attention_types`` and ``per_layer_config`` follow suit;
    * special token ids (``*_token_id``) outside the shrunk vocabulary become its last id;
    * sub-configs (``cls.sub_configs``) are shrunk by the same rule;
    * an unset ``layer_types`` becomes full attention everywhere (some models index it), a kept
      ``layer_types`` with no full attention layer left (of defaults that have one) ends with one, and an
      empty ``rope_parameters`` next to ``layer_types`` gets default RoPE per layer type (some models look
      their RoPE up by layer type);
    * an attention sub-config (``*attn*``) gets the parent's ``rope_theta`` where it has none (a model
      may read it there).
    """
    import transformers

    base = cls() if base is None else base
    old = base.to_dict()
    init = {f.name for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else set(old)
    kw: dict = {}
    subs = getattr(cls, "sub_configs", None) or {}
    for key, value in old.items():
        sub = getattr(base, key, None) if key in subs else None
        if isinstance(sub, transformers.PretrainedConfig):
            kw[key] = shrink(type(sub), sub)
            theta = (old.get("rope_parameters") or {}).get("rope_theta")
            if "attn" in key and theta is not None and not hasattr(kw[key], "rope_theta"):
                kw[key].rope_theta = theta
            continue
        new = _rule(key, value, kw, old)
        if new != value and key in init:
            kw[key] = new
    layers_key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in kw), None)
    if layers_key is not None:
        n_old, n_new = old[layers_key], kw[layers_key]
        for key, value in old.items():
            if key in init and isinstance(value, list) and len(value) == n_old and n_old != n_new:
                kw[key] = value[:n_new]
                if key == "layer_types" and "full_attention" in value and "full_attention" not in kw[key]:
                    kw[key][-1] = "full_attention"  # hybrids (linear attention, SSM, conv) need one
            elif key in init and key.endswith("_layers") and isinstance(value, list) \
                    and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                kw[key] = [i for i in value if i < n_new]
            elif key == "attention_types" and isinstance(value, list):  # run-length [[pattern, repeats]]
                kw[key] = [[pattern, max(1, n_new // len(pattern))] for pattern, _ in value[:1]]
            elif key == "per_layer_config" and isinstance(value, dict):  # {"layer index": {field: value}}
                kw[key] = {i: {f: _rule(f, v, kw, old) for f, v in fields.items()}
                           for i, fields in value.items() if int(i) < n_new}
        if "layer_types" in init and old.get("layer_types", "") is None:
            kw["layer_types"] = ["full_attention"] * n_new
    if old.get("rope_parameters") == {} and kw.get("layer_types", old.get("layer_types")):
        kw["rope_parameters"] = {t: {"rope_type": "default", "rope_theta": 10000.0}
                                 for t in set(kw.get("layer_types", old.get("layer_types")))}
    vocab = kw.get("vocab_size", old.get("vocab_size"))
    for key, value in old.items() if isinstance(vocab, int) else ():
        if key in init and key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
            kw[key] = vocab - 1
        elif key in init and key.endswith("_token_id") and isinstance(value, list):
            kw[key] = [min(v, vocab - 1) if isinstance(v, int) else v for v in value]
    return cls(**kw)


def tiny_config(arch: str):
    """The tiny config of registry name ``arch``: :func:`shrink` of its config class, or, where the causal-LM
    class is built from a sub-config of it (a decoder or text config), of that sub-config (the other
    sub-configs, e.g. audio or vision towers the causal LM does not build, may not shrink consistently)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    own = getattr(transformers.MODEL_FOR_CAUSAL_LM_MAPPING[cls], "config_class", cls)
    base = cls()
    for key in (getattr(cls, "sub_configs", None) or {}) if own is not cls else ():
        if isinstance(getattr(base, key, None), own):
            return shrink(own, getattr(base, key))
    return shrink(cls, base)
