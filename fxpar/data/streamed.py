"""Data files read as streams: each rank reads and tokenizes only its share, in order, holding no file.

Which path (``fxpar train --streaming auto|on|off``, :func:`use_streaming`): ``auto`` streams a file
larger than ``STREAM_ABOVE`` (8 MiB) that can be streamed (plain text, one document per line, or JSON
lines); a smaller one is read whole (:class:`fxpar.data.TokenDataset`: a full permutation per epoch,
statistics of the whole file). A file read whole costs each rank over a hundred times its size in
memory at its peak (Arrow rows, Python strings, the tokenizer's encodings, token lists, tensors: 2.1
GiB for 16 MiB of JSON lines), a streamed one nothing that grows with the file (docs/benchmarks.md).

How: ``n`` readers (:class:`fxpar.data.reader.ShardReader`), reader ``j`` run by rank ``j mod world``,
each reading only its chunks of the file. ``n`` divides the global batch: the greatest common divisor
of ``batch`` and the world size, so that every rank runs one reader where the batch allows; a saved
position keeps its ``n``, so a run resumed on another world size reads the same rows. A global batch is
reader 0's ``batch / n`` rows, then reader 1's, and so on: each row is read and tokenized by one rank
only, then the rows go to every rank with one ``all_gather_object`` per batch (``batch x seq`` token
ids, with each reader's position). Every rank thus holds the same global batch, as on the in-memory
path, and the compiled model takes it as before: each data-parallel replica (its tensor and pipeline
peers alike) runs its slice, and the loss weighs each microbatch by its share of the label tokens of
the whole batch, which a rank can count only with every replica's rows in hand.

Epochs: when a reader runs out of chunks, the epoch ends for all (the rows the other readers still
hold, about a chunk and a shuffle buffer each at most, are skipped that epoch, as the in-memory path
skips what is left after the last full batch) and every reader starts the next epoch.

Errors: the first rows of the file are read and encoded by every rank on construction (a missing field,
chat data without a chat template, seq over the model's maximum: before any communication); a bad row
met later travels with the batch, and every rank raises it, naming the reader and rank that read it,
rather than one rank failing while the others wait for it.

Statistics: ``documents`` and ``tokens`` (:meth:`StreamedBatches.progress`) count what the readers have
taken so far (every reader's position travels with each batch); the whole file is never counted.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fxpar.data import lines as L
from fxpar.data.dataset import check_model, filler_rows
from fxpar.data.encode import encode_chat, encode_text
from fxpar.data.reader import ShardReader
from fxpar.data.spec import DataSpec
from fxpar.ir.errors import PlanError
from fxpar.runtime import dist_calls

STREAM_ABOVE = 8 << 20  # bytes: --streaming auto streams larger files
MODES = ("auto", "on", "off")


def use_streaming(spec: DataSpec, mode: str = "auto") -> bool:
    """Whether ``spec``'s file is streamed under ``mode``; ``on`` for a file that cannot be streamed is
    a :class:`PlanError` saying why."""
    if mode not in MODES:
        raise PlanError(f"--streaming {mode!r}: give one of {', '.join(MODES)}")
    if mode == "off" or not spec.path.is_file():  # a missing file: the in-memory path names it
        return False
    why = L.streamable(spec)
    if mode == "on" and why:
        raise PlanError(f"data {spec.path}: cannot stream it: {why}", fix="read it whole with --streaming off")
    return why is None and (mode == "on" or spec.path.stat().st_size > STREAM_ABOVE)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StreamedDataset:
    """A data file read by readers (module docstring): validated on construction, no rows held.

    Attributes as :class:`fxpar.data.TokenDataset`'s where they do not need the whole file: ``spec``,
    ``seq``, ``kind``, ``keys``, ``pad_id``, ``max_positions``, ``shuffle_buffer`` (documents; 0: file
    order), ``size`` (bytes)."""

    def __init__(self, spec: DataSpec, tokenizer, *, max_positions: int | None = None, position_ids: bool = True,
                 shuffle_buffer: int = 0):
        self.spec, self.seq, self.tokenizer = spec, spec.seq, tokenizer
        self.pad_id = check_model(spec, tokenizer, max_positions)
        self.max_positions = max_positions
        if shuffle_buffer < 0:
            raise PlanError(f"data {spec.path}: shuffle buffer {shuffle_buffer}: give 0 (file order) or more documents")
        self.shuffle_buffer = shuffle_buffer
        if not spec.path.is_file():
            raise PlanError(f"data file {spec.path} does not exist" if not spec.path.exists()
                            else f"data {spec.path} is not a file", fix="give the path of a .txt or .jsonl file")
        why = L.streamable(spec)
        if why:
            raise PlanError(f"data {spec.path}: cannot stream it: {why}", fix="read it whole with --streaming off")
        self.size = spec.path.stat().st_size
        self.kind, docs, where = L.head(spec)
        self.encode(docs, where)  # the chat template on the first rows, before any communication
        if not spec.pack:
            self.keys = ("input_ids", "labels", "attention_mask")
        else:
            self.keys = ("input_ids", "labels", "position_ids") if position_ids else ("input_ids", "labels")

    def parse(self, raw: bytes, where: str):
        return L.parse(self.spec, self.kind, raw, where)

    def encode(self, docs: list, where: list[str]) -> list:
        if self.kind == "chat":
            return encode_chat(self.tokenizer, docs, self.spec.path, rows=where)
        return encode_text(self.tokenizer, docs)

    def reader(self, j: int, n: int, chunk: int, seed: int, buffer: int | None = None) -> ShardReader:
        """Reader ``j`` of ``n`` over chunks of ``chunk`` bytes (its file opened on first read)."""
        buffer = self.shuffle_buffer if buffer is None else buffer
        return ShardReader(self, L.LineFile(self.spec.path, chunk), j, n, seed, buffer)

    def filler(self, rows: int) -> dict:
        return filler_rows(self.keys, self.seq, self.pad_id, rows)

    def eval_batches(self, batch: int):
        """Every sample once, in file order per reader, ``batch`` rows at a time (the same batches on every
        rank; a reader that has run out fills its share with :meth:`filler` rows). A generator."""
        if batch < 1:
            raise PlanError(f"eval batch {batch} must be at least 1")
        rank, world = _world()
        n = math.gcd(batch, world)
        own = {j: self.reader(j, n, L.chunk_bytes(self.size, n), 0, buffer=0) for j in range(rank, n, world)}
        for r in own.values():
            r.begin(0)
        try:
            while True:
                parts = _exchange(_take(own, batch // n, partial=True), world, n)
                if all(rows["input_ids"].shape[0] == 0 for rows, _ in parts):
                    return
                yield {k: torch.cat([t for rows, _ in parts
                                     for t in (rows[k], self.filler(batch // n - rows[k].shape[0])[k])])
                       for k in self.keys}
        finally:
            for r in own.values():
                r.lines.close()

    def __repr__(self) -> str:
        how = "packed" if self.spec.pack else "padded"
        return f"StreamedDataset({self.spec.path}, {self.kind}, {self.size} bytes -> {how} samples of {self.seq})"


def _take(own: dict, per: int, partial: bool = False) -> dict:
    """Each of this rank's readers' next ``per`` rows and its position after them, or the error it met."""
    out = {}
    for j, r in own.items():
        try:
            rows = r.take(per, partial=partial)
            out[j] = (rows, r.state() if rows is not None else None, None)
        except Exception as e:  # every rank must hear of it: sent with the batch, raised below
            out[j] = (None, None, str(e) if isinstance(e, PlanError) else f"{type(e).__name__}: {e}")
    return out


def _exchange(mine: dict, world: int, n: int) -> list[tuple]:
    """Every reader's ``(rows, position)`` in reader order, gathered from every rank; a reader's error
    raised on every rank."""
    parts = [mine]
    if world > 1:
        parts = dist_calls.all_gather_object(mine)
    every = {j: p for part in parts for j, p in part.items()}
    for j in range(n):
        if every[j][2] is not None:
            raise PlanError(f"{every[j][2]}\n  (met by reader {j} of {n}, on rank {j % world})")
    return [every[j][:2] for j in range(n)]


def initial_position() -> dict:
    return {"chunk": 0, "pos": None, "buffer": [], "draws": 0, "doc": None, "at": 0, "documents": 0, "tokens": 0}


class StreamedBatches:
    """Endless global batches of ``batch`` rows of a :class:`StreamedDataset` (module docstring), with
    :meth:`state_dict` / :meth:`load_state_dict` as :class:`fxpar.data.Batches`. ``readers``: how many
    (default: the gcd of ``batch`` and the world size, fixed at the first batch or by a loaded state)."""

    def __init__(self, ds: StreamedDataset, batch: int, seed: int = 0, readers: int | None = None):
        if batch < 1:
            raise PlanError(f"data {ds.spec.path}: batch {batch} must be at least 1")
        self.ds, self.batch, self.seed, self.n = ds, batch, seed, readers
        self.epoch, self.own, self.positions = 0, None, None

    def _setup(self, state: dict | None = None) -> None:
        self.rank, self.world = _world()
        if state is not None:
            self.n, self.chunk, self.epoch = int(state["readers"]), int(state["chunk_bytes"]), int(state["epoch"])
            self.positions = [dict(p) for p in state["positions"]]
        else:
            self.n = self.n or math.gcd(self.batch, self.world)
            self.chunk, self.positions = (L.chunk_bytes(self.ds.size, self.n),
                                          [initial_position() for _ in range(self.n)])
        if self.batch % self.n:
            raise PlanError(f"data {self.ds.spec.path}: a batch of {self.batch} rows "
                            f"does not divide among {self.n} readers",
                            fix="resume with the --batch the run was saved with")
        if self.own is not None:
            for r in self.own.values():
                r.lines.close()
        self.own = {j: self.ds.reader(j, self.n, self.chunk, self.seed) for j in range(self.rank, self.n, self.world)}
        for j, r in self.own.items():
            r.begin(self.epoch, self.positions[j])

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.own is None:
            self._setup()
        per = self.batch // self.n
        for fresh in (False, True):
            parts = _exchange(_take(self.own, per), self.world, self.n)
            if all(rows is not None for rows, _ in parts):
                self.positions = [pos for _, pos in parts]
                return {k: torch.cat([rows[k] for rows, _ in parts]) for k in self.ds.keys}
            if fresh:  # a whole epoch's share of some reader makes no batch
                short = [j for j, (rows, _) in enumerate(parts) if rows is None]
                raise PlanError(f"data {self.ds.spec.path}: {self.ds.size} bytes read by {self.n} readers make no "
                                f"global batch: reader {short[0]}'s share gives "
                                f"fewer than {per} rows of seq={self.ds.seq}",
                                values={"bytes": self.ds.size, "readers": self.n, "rows_per_reader": per},
                                fix="give more data, a smaller --batch or --seq, "
                                    "or read the file whole with --streaming off")
            self.epoch += 1  # a reader ran out: the epoch ends for every reader
            for r in self.own.values():
                r.begin(self.epoch)

    def progress(self) -> dict:
        """Documents and tokens taken by all readers so far (the same on every rank)."""
        if self.positions is None:
            return {"documents": 0, "tokens": 0}
        return {k: sum(p[k] for p in self.positions) for k in ("documents", "tokens")}

    def tokenized(self) -> int:
        """Documents this rank has tokenized (its readers' read-ahead and re-reads included)."""
        return sum(r.docs.tokenized for r in (self.own or {}).values())

    def state_dict(self) -> dict:
        """The position, JSON-able and the same on every rank: ``epoch``, ``readers``, each reader's
        position, and what must not change on resuming (file size, batch, seq, packing, shuffle buffer,
        chunk size, seed)."""
        if self.own is None:
            self._setup()
        return {"epoch": self.epoch, "readers": self.n, "chunk_bytes": self.chunk, "batch": self.batch,
                "seed": self.seed, "shuffle_buffer": self.ds.shuffle_buffer, "file_bytes": self.ds.size,
                "seq": self.ds.seq, "pack": self.ds.spec.pack, "positions": [dict(p) for p in self.positions]}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken (its seed and readers too); a state of another file
        size, batch, seq, packing or shuffle buffer is a :class:`PlanError` (its rows would be others)."""
        now = {"file_bytes": self.ds.size, "batch": self.batch, "seq": self.ds.seq, "pack": self.ds.spec.pack,
               "shuffle_buffer": self.ds.shuffle_buffer}
        differ = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if differ:
            raise PlanError(f"data {self.ds.spec.path}: the saved data position is for another stream: "
                            + ", ".join(f"{k} saved {a}, now {b}" for k, (a, b) in differ.items()),
                            fix="resume with the same data file, --batch, --seq, packing and --shuffle-buffer, "
                                "or start the data afresh")
        self.seed = int(state["seed"])
        self._setup(state)
