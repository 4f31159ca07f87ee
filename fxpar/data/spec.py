"""What a data file is (:class:`DataSpec`) and reading its documents through HF ``datasets``.

A file is read with ``datasets.load_dataset(builder, data_files=path, split="train",
keep_in_memory=True)``. ``load_dataset`` still prepares Arrow files in a cache directory first; several
ranks read the same file at the same moment, so each process gets its own temporary ``cache_dir``
(removed once the rows are in memory): no rank reads a half-written cache of another, nothing is left
in the user's home, and a changed file is never served from a stale cache. A file read this way is
read and tokenized whole by every rank, deterministically; large files are streamed instead, each
rank reading only its rows (:mod:`fxpar.data.streamed`, with the row rules of :func:`row_document`).

The format is told by ``format`` or, with ``"auto"``, by the file's suffix: ``.txt``/``.text`` are
plain text (one document per non-empty line), ``.jsonl``/``.json`` JSON lines (the ``field`` column,
or chat when the first row has ``messages_field``), ``.parquet`` a table with the same two choices.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fxpar.data.encode import row_label
from fxpar.ir.errors import PlanError

FORMATS = ("auto", "text", "json", "chat", "parquet")
SUFFIX_BUILDER = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class DataSpec:
    """A data file and how to turn it into training samples.

    ``format``: one of ``auto, text, json, chat, parquet`` (see the module docstring); ``field`` the
    text column of JSON / parquet rows, ``messages_field`` the chat column (a list of
    ``{"role", "content"}`` messages); ``seq`` the window / row length in tokens; ``pack`` concatenates
    documents into windows of ``seq`` tokens (else one padded row per document); ``sample_by`` how the
    ``text`` builder splits a plain-text file: ``"line"``, ``"paragraph"`` or ``"document"``.
    """

    path: str | Path
    format: str = "auto"
    field: str = "text"
    messages_field: str = "messages"
    seq: int = 64
    pack: bool = True
    sample_by: str = "line"

    def __post_init__(self):
        self.path = Path(self.path)
        if self.format not in FORMATS:
            raise PlanError(f"data {self.path}: unknown format {self.format!r}",
                            fix=f"use one of {', '.join(FORMATS)}")
        if not isinstance(self.seq, int) or self.seq < 2:
            raise PlanError(f"data {self.path}: seq={self.seq} is not a usable sequence length",
                            fix="give seq >= 2 tokens")
        if self.sample_by not in ("line", "paragraph", "document"):
            raise PlanError(f"data {self.path}: sample_by={self.sample_by!r} is not line, paragraph or document")

    def builder(self) -> str:
        """The ``datasets`` builder that reads the file: ``text``, ``json`` or ``parquet``."""
        suffix = self.path.suffix.lower()
        if self.format in ("text", "json", "parquet"):
            return self.format
        if suffix in SUFFIX_BUILDER:
            return SUFFIX_BUILDER[suffix]
        if self.format == "chat":
            return "json"
        raise PlanError(f"data {self.path}: cannot tell the format from the suffix {suffix!r}",
                        fix="name it with --format text|json|chat|parquet, or use a .txt/.jsonl/.parquet file")


def load_rows(spec: DataSpec):
    """The file as an in-memory ``datasets.Dataset`` (see the module docstring for the cache)."""
    if not spec.path.is_file():
        raise PlanError(f"data file {spec.path} does not exist" if not spec.path.exists()
                        else f"data {spec.path} is not a file", fix="give the path of a .txt, .jsonl or .parquet file")
    import datasets

    builder = spec.builder()
    kwargs = {"sample_by": spec.sample_by} if builder == "text" else {}
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    cache = tempfile.mkdtemp(prefix="fxpar-data-")
    try:
        return datasets.load_dataset(builder, data_files=str(spec.path), split="train", keep_in_memory=True,
                                     cache_dir=cache, **kwargs)
    except Exception as e:  # a parse error of the file: name the file and the builder
        raise PlanError(f"data {spec.path}: datasets could not read it as {builder}: {type(e).__name__}: {e}",
                        fix="check the file, or name its format with --format") from e
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()


def _missing(spec: DataSpec, row, name: str, fields, flag: str, kind: str) -> PlanError:
    chat = f", or --format chat for its {spec.messages_field!r} conversations" if (
        kind == "text" and spec.messages_field in fields) else ""
    return PlanError(f"data {spec.path}: {row_label(row)} has no {kind} field {name!r}; its fields: {sorted(fields)}",
                     fix=f"name the column with {flag} <name> (one of {sorted(fields)}){chat}")


def read_documents(spec: DataSpec) -> tuple[str, list]:
    """``("text", [str, ...])`` or ``("chat", [[message, ...], ...])``: one entry per document.

    Empty texts (blank lines of a text file) are skipped. A row without the named field is a
    :class:`PlanError` naming the file, the row, the fields it has and the ``--field`` fix.
    """
    table = load_rows(spec)
    columns = list(table.column_names)
    if len(table) == 0:
        raise PlanError(f"data {spec.path}: the file holds no rows", fix="give a file with at least one document")
    kind = "text"
    if spec.format == "chat":
        kind = "chat"
    elif spec.format in ("auto", "parquet") and spec.builder() != "text" and spec.messages_field in columns:
        kind = "chat" if table[0][spec.messages_field] is not None else "text"
    name, flag = (spec.messages_field, "--messages-field") if kind == "chat" else (spec.field, "--field")
    if name not in columns:
        raise _missing(spec, 1, name, columns, flag, kind)
    values = table[name]
    docs = []
    for i, value in enumerate(values):
        doc = row_document(spec, kind, i + 1, {name: value} if value is not None else table[i])
        if doc is not None:
            docs.append(doc)
    return kind, docs


def row_document(spec: DataSpec, kind: str, row, record: dict):
    """The document of one row (``record``: its fields): the text (None where it is blank: skipped) or the
    conversation. A row without the field, or a field of the wrong type, is a :class:`PlanError` naming
    ``row`` (a 1-based number, or the words a streamed reader gives)."""
    name, flag = (spec.messages_field, "--messages-field") if kind == "chat" else (spec.field, "--field")
    value = record.get(name)
    if value is None:
        raise _missing(spec, row, name, [k for k, v in record.items() if v is not None], flag, kind)
    if kind == "chat":
        return _messages(spec, row, value)
    if not isinstance(value, str):
        raise PlanError(f"data {spec.path}: {row_label(row)} field {name!r} is a {type(value).__name__}, "
                        "not a string", fix="point --field at a text column")
    return value if value.strip() else None


def _messages(spec: DataSpec, row, value) -> list[dict]:
    """One chat row as a list of ``{"role", "content", ...}`` dicts (keys Arrow filled with None dropped)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise PlanError(f"data {spec.path}: {row_label(row)} field {spec.messages_field!r} is not a list of "
                        f"{{'role', 'content'}} messages", fix="write chat rows as {\"messages\": [{\"role\": ..., "
                        "\"content\": ...}, ...]} or read the file as text with --format json")
    return [{k: v for k, v in m.items() if v is not None} for m in value]
