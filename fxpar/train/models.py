"""What ``fxpar inspect``, ``fxpar plan``, ``fxpar train`` and ``fxpar generate`` share: a model from a name or a
config, and example inputs for it."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import torch

from fxpar.ir.errors import InputError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face hub spells a repository
SAVED = ("a save_pretrained directory holds config.json, the weights (model.safetensors, or "
         "model-0000i-of-0000N.safetensors with model.safetensors.index.json) and the tokenizer "
         "(tokenizer.json, tokenizer_config.json)")


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` that is no existing path (nor a .json file name)."""
    return bool(HUB_ID.fullmatch(spec)) and not spec.endswith(".json") and not Path(spec).exists()


def hub_fix(spec: str) -> str:
    """The two ways to make a local directory of the hub repository ``spec``."""
    local = spec.rsplit("/", 1)[1]
    return (f"make the directory first, then pass it: `hf download {spec} --local-dir {local}` (older "
            f"huggingface_hub: `huggingface-cli download {spec} --local-dir {local}`), or in Python "
            f"AutoModelForCausalLM.from_pretrained({spec!r}).save_pretrained({local!r}) and "
            f"AutoTokenizer.from_pretrained({spec!r}).save_pretrained({local!r})")


def resolve_model(spec: str) -> tuple[str, str | Path]:
    """What the model argument of ``fxpar train / generate / plan / inspect`` names: ``("zoo", name)``,
    ``("directory", path)`` (a ``save_pretrained`` directory) or ``("config", path)`` (an HF config.json).
    Anything else is an :class:`InputError` saying what is missing: a directory without config.json (and
    what such a directory holds), a hub id (not downloaded: the commands that make a local directory), or
    neither a zoo name nor a path (the zoo's names, the nearest first)."""
    from fxpar import zoo

    if spec in zoo.ZOO_NAMES:
        return "zoo", spec
    path = Path(spec)
    if path.is_dir():
        if (path / "config.json").is_file():
            return "directory", path
        found = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
        inner = [p for p in path.iterdir() if (p / "config.json").is_file()]
        fix = f"pass {inner[0]}, which holds config.json" if len(inner) == 1 else \
            "pass the directory save_pretrained wrote (model.save_pretrained(DIR); tokenizer.save_pretrained(DIR)), " \
            "or fxpar train --export DIR"
        raise InputError(f"model directory {path} has no config.json (found: {', '.join(found[:8]) or 'nothing'}"
                         f"{', ...' if len(found) > 8 else ''}); {SAVED}", path=path, fix=fix)
    if path.is_file():
        return "config", path
    near = difflib.get_close_matches(spec, zoo.ZOO_NAMES, 3, 0.5)
    zoo_names = ", ".join(near + [n for n in zoo.ZOO_NAMES if n not in near])  # the nearest first
    if looks_like_hub_id(spec):
        raise InputError(f"model {spec!r} is no local path: it looks like a Hugging Face hub id, and fxpar does not "
                         "download models (it reads a local save_pretrained directory)", path=spec, fix=hub_fix(spec))
    raise InputError(f"model {spec!r} is neither a zoo name nor an existing path (a save_pretrained directory or a "
                     f"config.json)", path=spec,
                     fix=f"give a model directory, a config.json or a zoo name: {zoo_names}")


def model_directory(spec: str) -> Path | None:
    """``spec`` as a ``save_pretrained`` directory (its ``config.json`` inside); None for a zoo name or a
    config file; an :class:`InputError` for anything else (:func:`resolve_model`)."""
    kind, where = resolve_model(spec)
    return where if kind == "directory" else None


def directory_weights(path: Path) -> Path:
    """The weights of a model directory, as ``compile(..., weights=)`` reads them (each rank only its own
    shards): checked here, before any rank communicates: the files present, every shard's header
    readable, its tensors inside the file (:func:`fxpar.safetensors_check.check_directory`)."""
    from fxpar.safetensors_check import check_directory

    if (path / "model.safetensors.index.json").is_file() or (path / "model.safetensors").is_file():
        check_directory(path)
        return path
    found = sorted(p.name for p in path.iterdir())
    hint = ("it holds PyTorch .bin weights: load it with from_pretrained and save_pretrained it again "
            "(safetensors is the default)" if any(f.endswith(".bin") for f in found) else
            "write the model there with save_pretrained, or pass --meta to start from the initialiser")
    raise InputError(f"model directory {path} has no weights (model.safetensors or model.safetensors.index.json; "
                     f"found: {', '.join(found[:8]) or 'nothing'}): {hint}", path=path)


def load_model(spec: str, *, meta: bool = False, layers: int | None = None) -> torch.nn.Module:
    """A zoo name (``llama``), the path of an HF ``config.json``, or a ``save_pretrained`` directory
    (:func:`resolve_model`); built from the config, no download. A directory's model is always built on
    the meta device: its weights come from its safetensors files through
    ``compile(..., weights=directory_weights(dir))``."""
    from fxpar import zoo

    overrides = {} if layers is None else {"num_hidden_layers": layers}
    device = "meta" if meta else "cpu"
    kind, where = resolve_model(spec)
    if kind == "zoo":
        return zoo.build(spec, device=device, **overrides)
    import transformers

    if kind == "directory":
        config = _config(where / "config.json", lambda: transformers.AutoConfig.from_pretrained(
            where, local_files_only=True, **overrides))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return model.train()
    data = _config(where, lambda: json.loads(where.read_text()))
    if not isinstance(data, dict) or data.get("model_type") is None:
        raise InputError(f"{where} has no 'model_type': it is not a Hugging Face config.json", path=where,
                         fix="give the config.json save_pretrained wrote, or its directory")
    model_type = data.pop("model_type")
    data.update(overrides)
    config = _config(where, lambda: transformers.AutoConfig.for_model(model_type, **data))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.train()


def _config(path: Path, read):
    """``read()``, with what goes wrong reading the config file ``path`` named as an :class:`InputError`."""
    try:
        return read()
    except (ValueError, KeyError, OSError) as e:  # bad JSON, an unknown model_type, an unreadable file
        raise InputError(f"{path}: transformers could not read it as a model config: {type(e).__name__}: {e}",
                         path=path, fix="give the config.json save_pretrained wrote (a newer transformers may be "
                                        "needed for a newer model_type)") from e


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

