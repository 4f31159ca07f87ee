"""The tokenizer of a Hugging Face model directory, loaded the way ``from_pretrained`` users load it.

Only local files are read (``local_files_only=True``): fxpar never reaches the hub. A directory that
holds no tokenizer file is a :class:`PlanError` naming the directory and the fix, before anything else
runs, so every rank fails the same way before it communicates.
"""

from __future__ import annotations

from pathlib import Path

from fxpar.ir.errors import InputError, PlanError

# The files one of transformers' tokenizer classes reads; a directory with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model",
                   "vocab.json", "vocab.txt", "merges.txt", "sentencepiece.bpe.model")


def load_tokenizer(model_dir, **kwargs):
    """``AutoTokenizer.from_pretrained(model_dir, local_files_only=True, **kwargs)``.

    Raises :class:`PlanError` when ``model_dir`` is not a directory or holds no tokenizer file.
    A tokenizer without a padding token gets ``pad_token = eos_token`` (as most causal-LM recipes do):
    padded positions are masked out of attention and of the loss, so the id only has to exist.
    """
    from fxpar.train.models import hub_fix, looks_like_hub_id

    path = Path(model_dir)
    if looks_like_hub_id(str(model_dir)):
        raise InputError(f"tokenizer {str(model_dir)!r} is no local path: it looks like a Hugging Face hub id, and "
                         "fxpar does not download tokenizers", path=model_dir, fix=hub_fix(str(model_dir)))
    if not path.is_dir():
        raise InputError(f"tokenizer: {path} is not a directory", path=path,
                         fix="pass a model directory written by save_pretrained "
                             "(config.json, weights, tokenizer files)")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        have = sorted(p.name for p in path.iterdir())[:12]
        raise PlanError(f"tokenizer: {path} holds no tokenizer files "
                        f"(looked for {', '.join(TOKENIZER_FILES[:3])}, ...; it has {have})",
                        fix="save the tokenizer next to the model: tokenizer.save_pretrained(model_dir)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    except (OSError, ValueError) as e:
        raise PlanError(f"tokenizer: AutoTokenizer could not load {path}: {e}",
                        fix="check the tokenizer files there (tokenizer.json / tokenizer_config.json)") from e
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
