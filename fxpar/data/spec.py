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

import codecs
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fxpar.data.encode import row_label
from fxpar.ir.errors import InputError, PlanError

FORMATS = ("auto", "text", "json", "chat", "parquet")
NO_ROWS = "give a file with at least one document (a non-blank line, row or conversation)"
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
    """The file as an in-memory ``datasets.Dataset`` (see the module docstring for the cache). An empty
    file, or one ``datasets`` cannot read, is an :class:`InputError` naming the file and, for JSON, the
    line and the JSON error (:func:`diagnose`)."""
    if not spec.path.is_file():
        raise InputError(f"data file {spec.path} does not exist" if not spec.path.exists()
                         else f"data {spec.path} is not a file", path=spec.path,
                         fix="give the path of a .txt, .jsonl or .parquet file")
    if spec.path.stat().st_size == 0:
        raise InputError(f"data {spec.path}: the file is empty (0 bytes)", path=spec.path, fix=NO_ROWS)
    import datasets

    builder = spec.builder()
    kwargs = {"sample_by": spec.sample_by} if builder == "text" else {}
    bars, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own log of a parse error: said below instead
    cache = tempfile.mkdtemp(prefix="fxpar-data-")
    try:
        return datasets.load_dataset(builder, data_files=str(spec.path), split="train", keep_in_memory=True,
                                     cache_dir=cache, **kwargs)
    except Exception as e:  # a parse error of the file: name the file, the line, the cause
        raise diagnose(spec, builder, e) from e
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def diagnose(spec: DataSpec, builder: str, error: Exception) -> InputError:
    """Why ``datasets`` could not read the file. Its own errors name neither the line nor the JSON error
    ("An error occurred while generating the dataset", ``StopIteration``), so a JSON file is read again
    here, on this failure path only: a JSON-lines file line by line until the first line that does not
    parse, a JSON document whole. Otherwise the innermost cause of the library's error."""
    with open(spec.path, "rb") as f:
        blank = not any(raw.strip() for raw in f)  # stops at the first line with something on it
    if blank:
        return InputError(f"data {spec.path}: the file holds no rows (every line is blank)", path=spec.path,
                          fix=NO_ROWS)
    if builder == "json":
        with open(spec.path, "rb") as f:
            lines = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"{"
            f.seek(0)
            if lines:  # JSON lines: the first line that is not a JSON object
                for number, raw in enumerate(f, 1):
                    text = raw.decode("utf-8", errors="replace").rstrip("\r\n").lstrip("\ufeff")
                    if text.strip():
                        json_record(spec, text, f"line {number}")  # raises, naming the line
            else:
                try:
                    json.loads(f.read().decode("utf-8", errors="replace").lstrip("\ufeff"))
                except ValueError as e:
                    where = f"line {e.lineno}, column {e.colno}" if isinstance(e, json.JSONDecodeError) else "it"
                    return InputError(f"data {spec.path}: not valid JSON at {where}: {getattr(e, 'msg', e)}",
                                      path=spec.path,
                                      fix="fix the JSON there, or write JSON lines (one object per line)")
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    why = f"{type(error).__name__}: {error}" + (f" ({type(cause).__name__}: {cause})" if cause is not error else "")
    return InputError(f"data {spec.path}: datasets could not read it as {builder}: {why}", path=spec.path,
                      fix="check the file, or name its format with --format text|json|chat|parquet")


def json_record(spec: DataSpec, line: str, where: str) -> dict:
    """One JSON line as a dict; a line that is not a JSON object is an :class:`InputError` naming ``where``
    and the JSON error (its column)."""
    try:
        out = json.loads(line)
    except ValueError as e:
        what = (f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"
                if isinstance(e, json.JSONDecodeError) else str(e))
        raise InputError(f"data {spec.path}: {where} is not valid JSON: {what}", path=spec.path,
                         fix=f"fix or remove {where} (JSON lines: one object per line)") from e
    if not isinstance(out, dict):
        raise InputError(f"data {spec.path}: {where} is a JSON {type(out).__name__}, not an object", path=spec.path,
                         fix="write one JSON object per line")
    return out


def is_chat(value) -> bool:
    """A conversation: a non-empty list of ``{"role", "content"}`` dicts."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                            for m in value)


def _missing(spec: DataSpec, row, name: str, record: dict, kind: str) -> InputError:
    """A row without the field ``name``: the error names the file, the row, the field and the fields the
    row has, and the fix follows what those fields hold (a conversation: ``--messages-field``; a text:
    ``--field``)."""
    fields = {k: v for k, v in record.items() if v is not None}
    chats = [k for k, v in fields.items() if is_chat(v)]
    texts = [k for k, v in fields.items() if isinstance(v, str)]
    fixes = []
    if chats:
        fixes.append(f"its {chats[0]!r} field is a conversation (a list of {{role, content}} messages): read the "
                     f"rows as chat with --messages-field {chats[0]}"
                     + (" --format chat" if spec.format == "json" else ""))
    if texts:
        fixes.append(f"its text is in {texts[0]!r}: --field {texts[0]}" + (
            " --format json" if kind == "chat" else "")
            + (f" (text fields: {', '.join(texts)})" if len(texts) > 1 else ""))
    if not fixes:
        fixes.append("none of its fields holds a text (a string) or a conversation (a list of {role, content} "
                     "messages): give a file whose rows do")
    return InputError(f"data {spec.path}: {where_row(spec, row)} has no {kind} field {name!r}; its fields: "
                      f"{sorted(fields)}", path=spec.path, fix="; or ".join(fixes))


def where_row(spec: DataSpec, row) -> str:
    """How an error names a row: ``row N (1-based)``, with its line where the file is JSON lines (whose
    blank lines make no row), or the words a streamed reader gives."""
    if not isinstance(row, int) or spec.builder() != "json":
        return row_label(row)
    with open(spec.path, "rb") as f:
        count = 0
        for number, raw in enumerate(f, 1):
            count += bool(raw.strip())
            if count == row:
                return f"row {row} (line {number})"
    return row_label(row)


def read_documents(spec: DataSpec) -> tuple[str, list]:
    """``("text", [str, ...])`` or ``("chat", [[message, ...], ...])``: one entry per document.

    Empty texts (blank lines of a text file) are skipped. A row without the named field is an
    :class:`InputError` naming the file, the row, the fields it has and the fix those fields call for
    (``--field`` for a text, ``--messages-field`` for a conversation); a file with no document is one too.
    """
    table = load_rows(spec)
    columns = list(table.column_names)
    if len(table) == 0:
        raise InputError(f"data {spec.path}: the file holds no rows", path=spec.path, fix=NO_ROWS)
    kind = "text"
    if spec.format == "chat":
        kind = "chat"
    elif spec.format in ("auto", "parquet") and spec.builder() != "text" and spec.messages_field in columns:
        kind = "chat" if table[0][spec.messages_field] is not None else "text"
    name = spec.messages_field if kind == "chat" else spec.field
    if name not in columns:
        raise _missing(spec, 1, name, table[0], kind)
    values = table[name]
    docs = []
    for i, value in enumerate(values):
        doc = row_document(spec, kind, i + 1, {name: value} if value is not None else table[i])
        if doc is not None:
            docs.append(doc)
    if not docs:
        raise InputError(f"data {spec.path}: its {len(table)} rows are all blank", path=spec.path, fix=NO_ROWS)
    return kind, docs


def row_document(spec: DataSpec, kind: str, row, record: dict):
    """The document of one row (``record``: its fields): the text (None where it is blank: skipped) or the
    conversation. A row without the field, or a field of the wrong type, is a :class:`PlanError` naming
    ``row`` (a 1-based number, or the words a streamed reader gives)."""
    name = spec.messages_field if kind == "chat" else spec.field
    value = record.get(name)
    if value is None:
        raise _missing(spec, row, name, record, kind)
    if kind == "chat":
        return _messages(spec, row, value)
    if not isinstance(value, str):
        fix = (f"the field is a conversation: read the rows as chat with --messages-field {name}" if is_chat(value)
               else "point --field at a text column")
        raise InputError(f"data {spec.path}: {where_row(spec, row)} field {name!r} is a {type(value).__name__}, "
                         "not a string", path=spec.path, fix=fix)
    return value if value.strip() else None


def _messages(spec: DataSpec, row, value) -> list[dict]:
    """One chat row as a list of ``{"role", "content", ...}`` dicts (keys Arrow filled with None dropped)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise InputError(f"data {spec.path}: {where_row(spec, row)} field {spec.messages_field!r} is not a list of "
                         f"{{'role', 'content'}} messages", path=spec.path, fix="write chat rows as {\"messages\": "
                         "[{\"role\": ..., \"content\": ...}, ...]} or read the file as text with --format json")
    return [{k: v for k, v in m.items() if v is not None} for m in value]
