"""A plain-text or JSON-lines file read in byte chunks, so that each of several readers reads only its rows.

``datasets`` streams a file as one shard (``split_dataset_by_node`` would have every rank parse every
row and keep one in N), so the cutting is done here: the file is cut into chunks of ``chunk_bytes``, and
a line belongs to the chunk its first byte lies in (a line that runs past its chunk's end is read whole
by that chunk's reader and skipped by the next chunk's), so the chunks partition the lines and a reader
finds its first line with one seek and one ``readline``. A line is known by its byte offset: a reader's
position is a few integers, and a document is read again by seeking to it.

Rows become documents by the rules of the in-memory path (:func:`fxpar.data.spec.row_document`): a
text file's lines (universal newlines as ``datasets``' text builder reads them, blank lines skipped),
a JSON line's ``field`` or, for chat, its ``messages_field``. :func:`head` reads the first rows of the
file, which tell text from chat and are checked before any rank communicates.
"""

from __future__ import annotations

import codecs

from fxpar.data.spec import NO_ROWS, DataSpec, json_record, row_document
from fxpar.ir.errors import InputError, PlanError

CHUNK_BYTES = 1 << 20  # a reader's unit of the file; smaller files get smaller chunks (chunk_bytes)
HEAD_ROWS = 32  # rows every rank reads and encodes before it communicates


def chunk_bytes(size: int, readers: int) -> int:
    """1 MiB, or less for a small file, so that each of ``readers`` has about 16 chunks (at least 64 bytes)."""
    return max(64, min(CHUNK_BYTES, -(-size // (readers * 16))))


def streamable(spec: DataSpec) -> str | None:
    """None when the file can be read in chunks, else why not (the fix is the in-memory path)."""
    builder = spec.builder()
    if builder == "parquet":
        return "parquet files are read whole (streamed reading takes plain text and JSON lines)"
    if builder == "text" and spec.sample_by != "line":
        return f"a text file split by {spec.sample_by} is read whole (streamed reading takes one document per line)"
    if builder == "json":
        with open(spec.path, "rb") as f:
            first = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()[:1]
        if first and first != b"{":
            return "the file is not JSON lines (one object per line; a JSON array is read whole)"
    return None


def kind_of(spec: DataSpec, first: dict | None) -> str:
    """``chat`` or ``text``, as :func:`fxpar.data.spec.read_documents` tells them: ``--format chat``, or a
    JSON file whose first row has the messages field."""
    if spec.format == "chat":
        return "chat"
    if spec.format == "auto" and spec.builder() == "json" and first is not None \
            and first.get(spec.messages_field) is not None:
        return "chat"
    return "text"


def decode(spec: DataSpec, raw: bytes, where: str) -> str:
    """One line's text, without its line break (universal newlines) or a byte-order mark, as datasets reads it."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PlanError(f"data {spec.path}: {where} is not UTF-8 ({e})", fix="write the file as UTF-8") from e
    return line.rstrip("\n").rstrip("\r").lstrip("\ufeff")


def parse(spec: DataSpec, kind: str, raw: bytes, where: str):
    """The document of one line (None: a blank line or text, skipped); ``where`` names it in errors."""
    line = decode(spec, raw, where)
    if not line.strip():
        return None
    if spec.builder() == "text":  # one column, "text", as the text builder makes it
        return row_document(spec, kind, where, {"text": line})
    return row_document(spec, kind, where, json_record(spec, line, where))


def head(spec: DataSpec, rows: int = HEAD_ROWS) -> tuple[str, list, list[str]]:
    """``(kind, documents, where)`` of the file's first ``rows`` non-blank lines, each checked as any row is
    (a missing field, a wrong type: the :class:`PlanError` names the line)."""
    if spec.path.stat().st_size == 0:
        raise InputError(f"data {spec.path}: the file is empty (0 bytes)", path=spec.path, fix=NO_ROWS)
    docs, where, kind = [], [], None
    with open(spec.path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if len(docs) >= rows:
                break
            label = f"line {number}"
            if kind is None:
                if not decode(spec, raw, label).strip():
                    continue
                first = None if spec.builder() == "text" else json_record(spec, decode(spec, raw, label), label)
                kind = kind_of(spec, first)
            doc = parse(spec, kind, raw, label)
            if doc is not None:
                docs.append(doc)
                where.append(label)
    if not docs:
        raise InputError(f"data {spec.path}: the file holds no document (every line is blank, or its text empty)",
                         path=spec.path, fix=NO_ROWS)
    return kind, docs, where


class LineFile:
    """The chunks of one file: ``lines(chunk, start)`` reads the lines that start in a chunk, ``line_at``
    one line by its offset. Reads what it is asked for and nothing else (``bytes_read`` counts it)."""

    def __init__(self, path, chunk: int):
        self.path, self.chunk = path, chunk
        self.size = path.stat().st_size
        self.chunks = max(1, -(-self.size // chunk))
        self.bytes_read = 0
        self._seq = self._rand = None

    def _open(self, which: str):
        if getattr(self, which) is None:
            setattr(self, which, open(self.path, "rb"))  # noqa: SIM115 (held for the reader's life)
        return getattr(self, which)

    def lines(self, chunk: int, start: int | None = None):
        """``(offset, raw line)`` for each line that starts in ``chunk`` at ``start`` or later (None: from the
        chunk's first line)."""
        lo, hi = chunk * self.chunk, min((chunk + 1) * self.chunk, self.size)
        f = self._open("_seq")
        if start is None and lo > 0:  # the line running into the chunk belongs to the chunk before
            f.seek(lo - 1)
            start = lo - 1 + len(f.readline())
            self.bytes_read += start - lo + 1
        pos = lo if start is None else start
        f.seek(pos)
        while pos < hi:
            raw = f.readline()
            if not raw:
                return
            self.bytes_read += len(raw)
            yield pos, raw
            pos += len(raw)
            f.seek(pos)  # cheap within the buffer; another generator may have moved the file

    def line_at(self, offset: int) -> bytes:
        f = self._open("_rand")
        f.seek(offset)
        raw = f.readline()
        self.bytes_read += len(raw)
        return raw

    def close(self) -> None:
        for which in ("_seq", "_rand"):
            if getattr(self, which) is not None:
                getattr(self, which).close()
                setattr(self, which, None)
