"""What ``fxpar inspect``, ``fxpar plan`` and ``fxpar train`` share: a model from a name or a config, and
example inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def load_model(spec: str, *, meta: bool = False, layers: int | None = None) -> torch.nn.Module:
    """A zoo name (``llama``) or the path of an HF ``config.json``; built from config, no download."""
    from fxpar import zoo

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    device = "meta" if meta else "cpu"
    if spec in zoo.ZOO_NAMES:
        return zoo.build(spec, device=device, **overrides)
    path = Path(spec)
    if not path.is_file():
        raise SystemExit(f"fxpar: {spec!r} is neither a zoo model ({', '.join(zoo.ZOO_NAMES)}) nor a config file")
    import transformers

    data = json.loads(path.read_text())
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise SystemExit(f"fxpar: {path} has no 'model_type'; it must be a Hugging Face config.json")
    data.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.train()


def example_kwargs(model: torch.nn.Module, batch: int, seq: int) -> dict:
    from fxpar import zoo

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = model_type if model_type in zoo.ZOO_NAMES else None
    if name is not None:
        return zoo.example_inputs(name, model, batch=batch, seq=seq)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), device="cpu").to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}

