"""Token samples of fixed length from a data file: packed windows or padded documents.

Packing (``DataSpec.pack=True``, run_clm's ``group_texts``): the documents, each ending with EOS, are
concatenated and cut into windows of ``seq`` tokens, the remainder dropped. With ``position_ids=True``
each window carries position ids that restart at 0 where a document starts (a document continued from
the previous window continues its count, wrapped at ``max_positions``), so a model that takes them
attends within each document only (transformers' ``DataCollatorWithFlattening``); the first token of
every document is labelled -100, so nothing is predicted across a document boundary. Labels are aligned
with ``input_ids``: HF models shift them inside the loss.

Padding (``pack=False``): one row per document, truncated to ``seq`` (one warning counts them),
right-padded with the pad id, ``attention_mask`` 1 on tokens and 0 on padding, labels -100 on padding.

Everything is built in the constructor, which also raises every data error (missing file or field, chat
data without a chat template, ``seq`` over the model's maximum), so all ranks fail before they
communicate. Each rank builds the same samples independently: reading and tokenizing are deterministic.
"""

from __future__ import annotations

import warnings

import torch

from fxpar.data.encode import IGNORE, encode_chat, encode_text
from fxpar.data.spec import DataSpec, read_documents
from fxpar.ir.errors import PlanError


def check_model(spec: DataSpec, tokenizer, max_positions: int | None) -> int:
    """What the model and tokenizer demand of ``spec`` (``seq`` within the model's maximum, an EOS to
    separate documents); the pad id (the EOS where the tokenizer has no pad token)."""
    if max_positions is not None and spec.seq > max_positions:
        raise PlanError(f"data {spec.path}: seq={spec.seq} is longer than the model's max_position_embeddings="
                        f"{max_positions}", values={"seq": spec.seq, "max_position_embeddings": max_positions},
                        fix=f"use --seq {max_positions} or less")
    if tokenizer.eos_token_id is None:
        raise PlanError(f"data {spec.path}: the tokenizer has no eos_token, which separates documents",
                        fix="set eos_token in the model directory's tokenizer_config.json")
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def filler_rows(keys, seq: int, pad_id: int, rows: int) -> dict:
    """``rows`` samples that count for nothing: pad ids, labels -100, attention 0 (where the data is
    padded), position ids 0..seq-1 (where it is packed with them)."""
    out = {}
    for k in keys:
        if k == "input_ids":
            out[k] = torch.full((rows, seq), pad_id, dtype=torch.long)
        elif k == "labels":
            out[k] = torch.full((rows, seq), IGNORE, dtype=torch.long)
        elif k == "attention_mask":
            out[k] = torch.zeros((rows, seq), dtype=torch.long)
        else:
            out[k] = torch.arange(seq).expand(rows, seq).clone()
    return out


class TokenDataset:
    """``len(ds)`` samples; ``ds[i]`` a dict of 1-D LongTensors of length ``seq``: ``input_ids``,
    ``labels`` and ``position_ids`` (packing with ``position_ids=True``) or ``attention_mask`` (padding).

    ``max_positions`` is the model's ``max_position_embeddings`` (``None``: no limit). Attributes:
    ``kind`` (``"text"`` / ``"chat"``), ``documents``, ``tokens`` (document tokens read), ``truncated``
    (documents cut to ``seq``), ``label_tokens`` (labels that are not -100), ``pad_id``, ``keys``.
    """

    def __init__(self, spec: DataSpec, tokenizer, *, max_positions: int | None = None, position_ids: bool = True):
        self.spec = spec
        self.seq = seq = spec.seq
        self.pad_id = check_model(spec, tokenizer, max_positions)
        self.kind, docs = read_documents(spec)
        encoded = encode_chat(tokenizer, docs, spec.path) if self.kind == "chat" else encode_text(tokenizer, docs)
        self.documents = len(encoded)
        self.tokens = sum(len(ids) for ids, _ in encoded)
        self.truncated = 0
        self.max_positions = max_positions
        if spec.pack:
            self._data = self._pack(encoded, position_ids)
        else:
            self._data = self._pad(encoded)
        self.keys = tuple(self._data)
        if len(self) == 0:
            raise PlanError(f"data {spec.path}: {self.documents} documents, {self.tokens} tokens make no window of "
                            f"seq={seq} tokens", values={"tokens": self.tokens, "seq": seq},
                            fix="give more data or a shorter --seq")
        self.label_tokens = int((self._data["labels"] != IGNORE).sum())

    def _pack(self, encoded, position_ids: bool) -> dict:
        seq = self.seq
        lengths = torch.tensor([len(ids) for ids, _ in encoded])
        ids = torch.tensor([t for d, _ in encoded for t in d], dtype=torch.long)
        labels = torch.tensor([t for _, d in encoded for t in d], dtype=torch.long)
        starts = torch.cumsum(lengths, 0) - lengths
        labels[starts] = IGNORE  # no prediction across a document boundary
        n = ids.numel() // seq
        out = {"input_ids": ids[:n * seq].view(n, seq), "labels": labels[:n * seq].view(n, seq)}
        if position_ids:
            pos = torch.arange(ids.numel()) - torch.repeat_interleave(starts, lengths)
            if self.max_positions is not None:
                pos = pos % self.max_positions
            out["position_ids"] = pos[:n * seq].view(n, seq)
        return out

    def _pad(self, encoded) -> dict:
        seq, n = self.seq, len(encoded)
        out = {"input_ids": torch.full((n, seq), self.pad_id, dtype=torch.long),
               "labels": torch.full((n, seq), IGNORE, dtype=torch.long),
               "attention_mask": torch.zeros((n, seq), dtype=torch.long)}
        for i, (ids, labels) in enumerate(encoded):
            if len(ids) > seq:
                self.truncated += 1
            k = min(len(ids), seq)
            out["input_ids"][i, :k] = torch.tensor(ids[:k])
            out["labels"][i, :k] = torch.tensor(labels[:k])
            out["attention_mask"][i, :k] = 1
        if self.truncated:
            warnings.warn(f"fxpar data {self.spec.path}: {self.truncated} of {n} documents are longer than "
                          f"seq={seq} tokens and were truncated (a longer --seq, or packing, keeps them whole)",
                          stacklevel=3)
        return out

    def __len__(self) -> int:
        return self._data["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} of a dataset of {len(self)}")
        return {k: v[i] for k, v in self._data.items()}

    def take(self, indices) -> dict:
        """The samples at ``indices`` stacked: a dict of ``(len(indices), seq)`` tensors."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        return {k: v[idx] for k, v in self._data.items()}

    def filler(self, rows: int) -> dict:
        """``rows`` samples that count for nothing (:func:`filler_rows`)."""
        return filler_rows(self.keys, self.seq, self.pad_id, rows)

    def __repr__(self) -> str:
        how = "packed" if self.spec.pack else "padded"
        return (f"TokenDataset({self.spec.path}, {self.kind}, {self.documents} documents, {self.tokens} tokens -> "
                f"{len(self)} {how} samples of {self.seq})")
