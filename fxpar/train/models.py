"""What ``fxpar inspect``, ``fxpar plan``, ``fxpar train`` and ``fxpar generate`` share: a model from a name or a config, and
example inputs for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fxpar.ir.errors import PlanError


def model_directory(spec: str) -> Path | None:
    """``spec`` as a ``save_pretrained`` directory (its ``config.json`` inside), or None."""
    path = Path(spec)
    return path if path.is_dir() and (path / "config.json").is_file() else None


def directory_weights(path: Path) -> Path:
    """The weights of a model directory, as ``compile(..., weights=)`` reads them (each rank only its own
    shards): checked here, before any rank communicates."""
    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        return path
    found = sorted(p.name for p in path.iterdir())
    hint = ("it holds PyTorch .bin weights: load it with from_pretrained and save_pretrained it again "
            "(safetensors is the default)" if any(f.endswith(".bin") for f in found) else
            "write the model there with save_pretrained, or pass --meta to start from the initialiser")
    raise PlanError(f"model directory {path} has no weights (model.safetensors or model.safetensors.index.json; "
                    f"found: {', '.join(found[:8]) or 'nothing'}): {hint}")


def load_model(spec: str, *, meta: bool = False, layers: int | None = None) -> torch.nn.Module:
    """A zoo name (``llama``), the path of an HF ``config.json``, or a ``save_pretrained`` directory; built
    from the config, no download. A directory's model is always built on the meta device: its weights
    come from its safetensors files through ``compile(..., weights=directory_weights(dir))``."""
    from fxpar import zoo

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    device = "meta" if meta else "cpu"
    if spec in zoo.ZOO_NAMES:
        return zoo.build(spec, device=device, **overrides)
    directory = model_directory(spec)
    if directory is not None:
        import transformers

        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True, **overrides)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.train()
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
        return zoo.example_inputs(name, model, batch=batch, seq=seq, stock=True)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, seq), device="cpu").to(device)
    return {"input_ids": ids, "labels": ids}  # the trace turns a stock config's KV cache off

