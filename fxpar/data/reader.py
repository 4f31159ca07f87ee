"""One reader's share of a streamed file: its documents in a seeded order, tokenized, as fixed-length rows.

Reader ``j`` of ``n`` reads chunks ``j, j + n, j + 2n, ...`` of the file (:mod:`fxpar.data.lines`) in
order or, when shuffling, every n-th chunk of a seeded permutation of all the chunks, one permutation
per epoch. It reads ahead ``READ_AHEAD`` documents at a time and tokenizes them in one call. With a
shuffle buffer of ``buffer`` documents (as ``datasets``' ``IterableDataset.shuffle(buffer_size=)``),
each document taken is a random one of the buffer and its place goes to the next one read; the random
numbers are a function of ``(seed, epoch, reader, draw number)``, so no generator state is saved.

Rows are made from this reader's documents, in its order, as :class:`fxpar.data.TokenDataset` makes
them from the whole file: packed windows (a document continues across a window boundary, its position
ids counting on, its first token labelled -100; the last partial window of an epoch dropped) or one
padded row per document (truncated to ``seq``, counted in ``truncated``).

The position (:meth:`ShardReader.state`, JSON-able): the chunk and offset of the next line to read, the
offsets of the buffered documents, the draws taken, the document being packed and how many of its
tokens are already in windows, and counts of the documents and tokens taken. :meth:`ShardReader.begin`
restores it by seeking to those documents and encoding them again.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import deque

import torch

from fxpar.data.encode import IGNORE

READ_AHEAD = 64  # documents read and tokenized in one call


def stream_seed(*parts) -> int:
    """A generator seed from ``parts``: a hash, so no two tuples share a sequence."""
    text = ":".join(str(p) for p in ("fxpar-stream", *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


class Documents:
    """Reader ``j`` of ``n``'s documents for one epoch, each ``(offset, ids, labels)``; ``next()`` gives
    None at the end of the epoch. ``tokenized`` counts the documents this reader has encoded."""

    def __init__(self, lines, parse, encode, j: int, n: int, seed: int, buffer: int):
        self.lines, self.parse, self.encode = lines, parse, encode
        self.j, self.n, self.seed, self.size = j, n, seed, buffer
        self.tokenized = 0
        self.epoch = 0

    def order(self, epoch: int) -> list[int]:
        """The chunks this reader reads in ``epoch``, in order."""
        if not self.size:
            return list(range(self.j, self.lines.chunks, self.n))
        g = torch.Generator().manual_seed(stream_seed(self.seed, epoch, "chunks"))
        return torch.randperm(self.lines.chunks, generator=g)[self.j::self.n].tolist()

    def begin(self, epoch: int, state: dict | None = None) -> None:
        """Start ``epoch`` from its beginning, or from ``state`` (a :meth:`state` of this epoch)."""
        state = state or {}
        self.epoch, self.chunks = epoch, self.order(epoch)
        self._ci, self._pos, self._lines = state.get("chunk", 0), state.get("pos"), None
        self._pending = deque()
        self.draws, self._block = state.get("draws", 0), (None, [])
        self.buffer = self._reread(state.get("buffer", []))

    def state(self) -> dict:
        if not self._pending:  # the next document's place, whatever was read ahead: one form per position
            self._read_ahead()
        ci, pos = self._pending[0][0] if self._pending else (len(self.chunks), None)
        return {"chunk": ci, "pos": pos, "buffer": [b[0] for b in self.buffer], "draws": self.draws}

    def _encode(self, docs: list, where: list[str]) -> list:
        self.tokenized += len(docs)
        return self.encode(docs, where) if docs else []

    def _reread(self, offsets: list[int]) -> list[tuple]:
        where = [f"the line at byte {o}" for o in offsets]
        docs = [self.parse(self.lines.line_at(o), w) for o, w in zip(offsets, where)]
        return [(o, ids, labels) for o, (ids, labels) in zip(offsets, self._encode(docs, where))]

    def at(self, offset: int) -> tuple:
        """The document whose line starts at ``offset``, read again."""
        return self._reread([offset])[0]

    def _read_ahead(self) -> bool:
        """Read and encode up to ``READ_AHEAD`` more documents; False at the end of the epoch's chunks."""
        docs, keys, where = [], [], []
        while len(docs) < READ_AHEAD and self._ci < len(self.chunks):
            if self._lines is None:
                self._lines = self.lines.lines(self.chunks[self._ci], self._pos)
            item = next(self._lines, None)
            if item is None:  # the chunk is done: the next one from its first line
                self._ci, self._pos, self._lines = self._ci + 1, None, None
                continue
            offset, raw = item
            self._pos = offset + len(raw)
            label = f"the line at byte {offset}"
            doc = self.parse(raw, label)
            if doc is not None:
                docs.append(doc)
                keys.append((self._ci, offset))
                where.append(label)
        self._pending.extend(zip(keys, self._encode(docs, where)))
        return bool(docs)

    def _pull(self):
        if not self._pending and not self._read_ahead():
            return None
        (_, offset), (ids, labels) = self._pending.popleft()
        return offset, ids, labels

    def _draw(self) -> float:
        block, at = divmod(self.draws, 256)
        if self._block[0] != block:
            g = torch.Generator().manual_seed(stream_seed(self.seed, self.epoch, self.j, block))
            self._block = (block, torch.rand(256, generator=g, dtype=torch.float64).tolist())
        self.draws += 1
        return self._block[1][at]

    def next(self):
        if not self.size:
            return self._pull()
        while len(self.buffer) < self.size:
            item = self._pull()
            if item is None:
                break
            self.buffer.append(item)
        if not self.buffer:
            return None
        i = int(self._draw() * len(self.buffer))
        out, new = self.buffer[i], self._pull()
        if new is not None:
            self.buffer[i] = new
        else:  # the chunks are done: the buffer empties in random order
            self.buffer[i] = self.buffer[-1]
            self.buffer.pop()
        return out


class ShardReader:
    """Rows of ``seq`` tokens from reader ``j`` of ``n`` of ``ds`` (a :class:`fxpar.data.streamed.StreamedDataset`)."""

    def __init__(self, ds, lines, j: int, n: int, seed: int, buffer: int):
        self.ds, self.lines, self.j = ds, lines, j
        self.docs = Documents(lines, ds.parse, ds.encode, j, n, seed, buffer)
        self.documents = self.tokens = self.truncated = 0
        self._doc, self._at = None, 0

    def begin(self, epoch: int, state: dict | None = None) -> None:
        """Start ``epoch`` afresh (the counts go on), or restore ``state``."""
        self.docs.begin(epoch, state)
        self._doc, self._at = None, 0
        if state is not None:
            self.documents, self.tokens = state["documents"], state["tokens"]
            if state["doc"] is not None:
                self._doc, self._at = self.docs.at(state["doc"]), state["at"]

    def state(self) -> dict:
        return {**self.docs.state(), "doc": self._doc[0] if self._doc else None, "at": self._at,
                "documents": self.documents, "tokens": self.tokens}

    def _next_doc(self):
        item = self.docs.next()
        if item is not None:
            self.documents += 1
            self.tokens += len(item[1])
        return item

    def take(self, count: int, partial: bool = False) -> dict | None:
        """The next ``count`` rows as ``(count, seq)`` tensors; at the end of the epoch None, or with
        ``partial`` the rows there were (perhaps none)."""
        rows = []
        while len(rows) < count:
            row = self._window() if self.ds.spec.pack else self._padded()
            if row is None:
                if not partial:
                    return None
                break
            rows.append(row)
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.long).view(len(rows), self.ds.seq)
                for k in self.ds.keys}

    def _window(self) -> dict | None:
        seq, ids, labels, pos = self.ds.seq, [], [], []
        while len(ids) < seq:
            if self._doc is None:
                self._doc, self._at = self._next_doc(), 0
                if self._doc is None:
                    return None
            _, d_ids, d_labels = self._doc
            t = self._at
            k = min(seq - len(ids), len(d_ids) - t)
            ids += d_ids[t:t + k]
            labels += ([IGNORE] + d_labels[1:k]) if t == 0 else d_labels[t:t + k]  # nothing predicted across documents
            pos += range(t, t + k)
            self._at += k
            if self._at == len(d_ids):
                self._doc, self._at = None, 0
        row = {"input_ids": ids, "labels": labels}
        if "position_ids" in self.ds.keys:
            top = self.ds.max_positions
            row["position_ids"] = [p % top for p in pos] if top else pos
        return row

    def _padded(self) -> dict | None:
        item = self._next_doc()
        if item is None:
            return None
        _, ids, labels = item
        seq = self.ds.seq
        k = min(len(ids), seq)
        if len(ids) > seq:
            self.truncated += 1
            if not getattr(self.ds, "warned", False):  # once per dataset
                self.ds.warned = True
                warnings.warn(f"fxpar data {self.ds.spec.path}: documents longer than seq={seq} tokens are truncated "
                              f"(reader {self.j}: first at byte {item[0]}; "
                              "a longer --seq, or packing, keeps them whole)",
                              stacklevel=4)
        return {"input_ids": ids[:k] + [self.ds.pad_id] * (seq - k), "labels": labels[:k] + [IGNORE] * (seq - k),
                "attention_mask": [1] * k + [0] * (seq - k)}
