"""Where a fine-tuning run's batches come from, behind one small interface (``next_batch``,
``state_dict``, ``load_state_dict``):

* :class:`TokenStream`: a tokenizer and local files through :mod:`fxpar.data` (text, JSON lines, chat,
  parquet; packed or padded), in a deterministic order whose position is saved in checkpoints: the
  whole file in memory (:class:`fxpar.data.Batches`) or, for large files, streamed, each rank reading
  only its share (:class:`fxpar.data.StreamedBatches`, chosen by the dataset it is given);
* :class:`SyntheticStream`: random tokens seeded by the batch's index (benchmarks, smoke tests);
* :class:`ByteStream`: a text file's UTF-8 bytes as token ids in consecutive windows, for models that
  come without a tokenizer (zoo names, a bare config.json).

Each stream also says where it is in its data as a fraction of epochs (``epoch()``; None for random
tokens, which have no length), for the progress line.

A training step takes ``accum`` batches of ``batch`` sequences and gives them to the compiled model as
one global batch of ``accum x batch`` rows cut into ``accum`` times the plan's microbatches, so that
each microbatch has the size it has without accumulation. The loss is the mean over every counted
label of the ``accum`` batches (fxpar weighs microbatches by their counted labels), which is what
Trainer computes with gradient accumulation (``num_items_in_batch``).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from fxpar.ir.errors import PlanError


class TokenStream:
    def __init__(self, data, batch: int, seed: int, shuffle: bool = True):
        from fxpar.data import Batches, StreamedBatches, StreamedDataset

        self.dataset = data
        if isinstance(data, StreamedDataset):  # its shuffling is the dataset's shuffle buffer
            self.kind, self.batches = "streamed", StreamedBatches(data, batch=batch, seed=seed)
        else:
            self.kind, self.batches = "tokens", Batches(data, batch=batch, seed=seed, shuffle=shuffle)

    def next_batch(self) -> dict:
        return dict(next(self.batches))

    def state_dict(self) -> dict:
        return {"kind": self.kind, **self.batches.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        kind = state.pop("kind", None)
        if kind != self.kind:
            how = {"tokens": "read whole (--streaming off)", "streamed": "streamed (--streaming on)"}
            raise PlanError(f"the checkpoint's data position belongs to {kind} data, this run's data is {self.kind}; "
                            "resume with the data it was saved with"
                            + (f", {how[kind]}" if kind in how else ""))
        self.batches.load_state_dict(state)

    def progress(self) -> dict:
        """Streamed data: documents and tokens read so far, for the metrics (the whole file is never counted)."""
        if self.kind != "streamed":
            return {}
        return {f"data_{k}": v for k, v in self.batches.progress().items()}

    def epoch(self) -> float:
        """Epochs done: samples taken over an epoch's batches; streamed, the chunks the furthest reader has
        read over its share of the file's (a chunk's precision, as its epoch ends when one reader's does)."""
        b = self.batches
        if self.kind != "streamed":
            return b.epoch + b.index / (b.steps_per_epoch * b.batch)
        if not b.positions:
            return float(b.epoch)
        chunks = max(1, -(-b.ds.size // b.chunk))
        share = [len(range(j, chunks, b.n)) for j in range(b.n)]
        return b.epoch + min(1.0, max(p["chunk"] / max(s, 1) for p, s in zip(b.positions, share)))


class SyntheticStream:
    def __init__(self, vocab: int, batch: int, seq: int, seed: int):
        self.vocab, self.batch, self.seq, self.seed, self.index = vocab, batch, seq, seed, 0

    def next_batch(self) -> dict:
        g = torch.Generator().manual_seed(self.seed + self.index)
        self.index += 1
        ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {"kind": "synthetic", "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])

    def epoch(self) -> None:
        return None


class ByteStream:
    def __init__(self, path: str, vocab: int, batch: int, seq: int):
        raw = Path(path).read_bytes()
        self.raw = torch.tensor(list(raw), dtype=torch.long) % vocab
        self.need, self.batch, self.seq, self.index = batch * seq, batch, seq, 0
        if self.raw.numel() < self.need:
            raise PlanError(f"--data {path} has {self.raw.numel()} bytes, fewer than one batch ({batch} x {seq}); "
                            "give a longer file, or a smaller --batch / --seq")

    def next_batch(self) -> dict:
        per = self.raw.numel() // self.need
        pos = (self.index % per) * self.need
        self.index += 1
        ids = self.raw[pos:pos + self.need].view(self.batch, self.seq)
        return {"input_ids": ids, "labels": ids.clone()}

    def state_dict(self) -> dict:
        return {"kind": "bytes", "index": self.index}

    def epoch(self) -> float:
        return self.index / (self.raw.numel() // self.need)

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])


def file_dataset(path: str, args, tokenizer, model):
    """The dataset of a data file for ``model``: read whole (:class:`fxpar.data.TokenDataset`) or, as
    ``args.streaming`` decides (:func:`fxpar.data.use_streaming`), streamed (:class:`fxpar.data.StreamedDataset`)."""
    from fxpar.data import DataSpec, StreamedDataset, TokenDataset, use_streaming

    if tokenizer is None:
        raise PlanError(f"--data/--eval-data {path}: reading files needs a tokenizer: give a model directory "
                        "that holds one, or --tokenizer DIR")
    a = args
    spec = DataSpec(path, format=a.format, field=a.field, messages_field=a.messages_field, seq=a.seq,
                    pack=not a.no_pack)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    top = getattr(model.config, "max_position_embeddings", None)
    if use_streaming(spec, a.streaming):  # each rank reads only its share
        return StreamedDataset(spec, tokenizer, max_positions=top, position_ids=takes_positions,
                               shuffle_buffer=a.shuffle_buffer)
    return TokenDataset(spec, tokenizer, max_positions=top, position_ids=takes_positions)


def describe(stream) -> str:
    """A line for the run's header where the data is streamed, else ''."""
    if getattr(stream, "kind", None) != "streamed":
        return ""
    return f"\ndata: {stream.dataset!r}, streamed by {stream.batches.n} readers (each rank reads only its share)"


def step_batch(stream, accum: int) -> dict:
    """``accum`` batches of ``stream`` as one global batch (rows concatenated in order)."""
    parts = [stream.next_batch() for _ in range(accum)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

