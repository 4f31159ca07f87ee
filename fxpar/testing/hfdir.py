"""Download-free Hugging Face model directories for tests and examples.

:func:`make_model_dir` writes what ``save_pretrained`` + ``tokenizer.save_pretrained`` write for a real
checkpoint: ``config.json``, sharded ``model-0000x-of-0000N.safetensors`` with
``model.safetensors.index.json``, and a byte-level BPE tokenizer trained here with the ``tokenizers``
library on the text it is given (the chat file the repo ships by default), with special tokens and a
chat template whose assistant turns sit in ``{% generation %}`` blocks (so ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` works). The model is a zoo architecture whose vocabulary is the
tokenizer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_FILE = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat_train.jsonl"
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(path: str | Path = CHAT_FILE) -> list[str]:
    """The texts of a JSON-lines file (its ``text`` fields, or every message's ``content``)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        out.extend([row["text"]] if "text" in row else [m["content"] for m in row.get("messages", [])])
    return out


def train_tokenizer(texts: list[str], vocab_size: int = 384, chat_template: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|eos|>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(path: str | Path, arch: str = "llama", *, max_shard_size: str | int = "128KB", seed: int = 0,
                   texts: list[str] | None = None, chat_template: bool = True, tokenizer: bool = True,
                   dtype: torch.dtype = torch.float32, **config) -> Path:
    """Write a tiny ``arch`` checkpoint (sharded safetensors + index) and its tokenizer into ``path``."""
    from fxpar import zoo

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts if texts is not None else corpus(), chat_template=chat_template)
    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    model = zoo.build(arch, seed=seed, **{**ids, "max_position_embeddings": 128, **config})
    model.config.use_cache = True  # a checkpoint as users have them: generation caches by default
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        tok.save_pretrained(path)
    return path
