"""Streamed data (``fxpar.data.streamed``) on one process, against the in-memory path computed here.

One reader in file order gives the in-memory path's unshuffled batches exactly (packed windows across
document and epoch boundaries, padded rows, chat labels, evaluation batches); several readers with a
shuffle buffer give each document to exactly one reader, at most once per epoch; a position saved
mid-epoch (mid-document, with a full shuffle buffer) restores the very same batches; a reader reads and
tokenizes only what the batches it makes need; each bad input is a clear error."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from fxpar.data import (
    IGNORE,
    Batches,
    DataSpec,
    StreamedBatches,
    StreamedDataset,
    TokenDataset,
    eval_batches,
    load_tokenizer,
    use_streaming,
)
from fxpar.data import streamed as S
from fxpar.data.reader import READ_AHEAD
from fxpar.ir.errors import PlanError
from fxpar.testing.hfdir import CHAT_FILE, make_model_dir

WORDS = "the capital of France is Paris and one plus eight is nine while grass is green".split()


def texts(n: int) -> list[str]:
    """``n`` distinct documents of 3 to 30 words."""
    return [f"doc {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + (i * 5) % 28)) for i in range(n)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    tok = load_tokenizer(make_model_dir(root / "model", "llama"))
    docs = texts(240)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)))
    (root / "docs.txt").write_text(
        "\n".join(d if i % 9 else d + "\n" for i, d in enumerate(docs)) + "\n")  # blank lines
    return root, tok, docs


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name,pack", [("docs.jsonl", True), ("docs.txt", True), ("docs.jsonl", False),
                                       ("chat", True), ("chat", False)])
def test_one_reader_in_file_order_is_the_in_memory_order(files, name, pack):
    root, tok, _ = files
    spec = DataSpec(CHAT_FILE if name == "chat" else root / name, seq=24, pack=pack)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # padded rows truncated: both paths say so
        whole = TokenDataset(spec, tok, max_positions=128)
        streamed = StreamedDataset(spec, tok, max_positions=128, shuffle_buffer=0)
        mem, stream = Batches(whole, 4, shuffle=False), StreamedBatches(streamed, 4, readers=1)
        for i in range(mem.steps_per_epoch + 5):  # into the second epoch
            assert _equal(next(mem), next(stream)), (name, pack, i)
    assert stream.epoch == mem.epoch == 1 and streamed.keys == whole.keys
    # evaluation: every sample once, the last batch filled with rows that count nothing, as in memory
    for a, b in zip(eval_batches(whole, 5), eval_batches(streamed, 5), strict=True):
        assert _equal(a, b)


def _reader_rows(stream: StreamedBatches, epoch: int = 0) -> list[list[dict]]:
    """Each reader's rows (in its order) of the batches of ``epoch``, one dict of 1-D tensors per row."""
    per = stream.batch // stream.n
    out = [[] for _ in range(stream.n)]
    while True:
        batch = next(stream)
        if stream.epoch < epoch:
            continue
        if stream.epoch > epoch:
            return out
        for j in range(stream.n):
            out[j] += [{k: v[i] for k, v in batch.items()} for i in range(j * per, (j + 1) * per)]


def test_readers_share_the_documents_once_per_epoch(files):
    root, tok, docs = files
    encoded = {tuple(tok(t)["input_ids"] + [tok.eos_token_id]) for t in docs}
    # padded: one row per document, the row's tokens its document
    padded = StreamedDataset(DataSpec(root / "docs.jsonl", seq=128, pack=False), tok, shuffle_buffer=16)
    for epoch in (0, 1):
        rows = [tuple(r["input_ids"][r["attention_mask"] == 1].tolist()) for part in
                _reader_rows(StreamedBatches(padded, 8, seed=1, readers=4), epoch) for r in part]
        assert len(rows) == len(set(rows)) and set(rows) <= encoded  # once at most
        assert len(rows) >= len(docs) - 4 * (16 + 10), len(rows)  # what is skipped: about a buffer + a chunk each
    # packed: each reader's windows in its order are its documents end to end (positions restart at 0)
    packed = StreamedDataset(DataSpec(root / "docs.jsonl", seq=16), tok, max_positions=1024, shuffle_buffer=16)
    seen = []
    for part in _reader_rows(StreamedBatches(packed, 8, seed=2, readers=4)):
        ids = torch.cat([r["input_ids"] for r in part]).tolist()
        pos = torch.cat([r["position_ids"] for r in part]).tolist()
        labels = torch.cat([r["labels"] for r in part]).tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
        assert starts[0] == 0 and all(labels[s] == IGNORE for s in starts[:-1])
        pieces = [tuple(ids[a:b]) for a, b in zip(starts, starts[1:])]
        assert all(p in encoded for p in pieces[:-1])  # the last may run past the epoch's last window
        assert all(labels[a + 1:b] == ids[a + 1:b] for a, b in zip(starts, starts[1:]))
        seen += pieces[:-1]
    assert len(seen) == len(set(seen)) and len(seen) >= len(docs) - 4 * (16 + 10)
    # shuffled: not the file order, another order each epoch and seed
    a, b = (_reader_rows(StreamedBatches(padded, 8, seed=s, readers=4)) for s in (1, 2))
    assert [r["input_ids"].tolist() for r in a[0][:8]] != [r["input_ids"].tolist() for r in b[0][:8]]


# unpacked, the file's longer documents are cut at seq=20 on purpose: a resume must give the same cut rows
@pytest.mark.filterwarnings(r"ignore:fxpar data .*documents longer than seq=20 tokens are truncated:UserWarning")
@pytest.mark.parametrize("pack,buffer", [(True, 0), (True, 12), (False, 30)])
def test_resume_mid_epoch_gives_the_same_batches(files, pack, buffer):
    root, tok, _ = files
    ds = StreamedDataset(DataSpec(root / "docs.jsonl", seq=20, pack=pack), tok, max_positions=128,
                         shuffle_buffer=buffer)
    for taken in (1, 7, 40):  # 40: past the end of the first epoch
        run = StreamedBatches(ds, 8, seed=5, readers=4)
        for _ in range(taken):
            next(run)
        state = json.loads(json.dumps(run.state_dict()))  # as the checkpoint holds it
        assert any(p["doc"] is not None for p in state["positions"]) or not pack  # mid-document
        resumed = StreamedBatches(ds, 8, seed=0)  # the seed and the 4 readers come from the state
        resumed.load_state_dict(state)
        assert resumed.n == 4 and resumed.state_dict() == state
        for i in range(30):
            assert _equal(next(run), next(resumed)), (taken, i)
        assert run.state_dict() == resumed.state_dict() and run.progress() == resumed.progress()
    with pytest.raises(PlanError, match="batch saved 8, now 4"):
        StreamedBatches(ds, 4).load_state_dict(state)
    other = StreamedDataset(DataSpec(root / "docs.jsonl", seq=20, pack=pack), tok, shuffle_buffer=buffer + 1)
    with pytest.raises(PlanError, match="shuffle_buffer saved"):
        StreamedBatches(other, 8).load_state_dict(state)


class CountingTokenizer:
    """The tokenizer, counting the texts it encodes."""

    def __init__(self, tok):
        self.tok, self.texts = tok, 0

    def __call__(self, texts, **kw):
        self.texts += len(texts)
        return self.tok(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_reader_reads_and_tokenizes_only_what_its_batches_need(files, tmp_path):
    root, tok, _ = files
    big = tmp_path / "big.jsonl"
    many = texts(4000)
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in many))
    counting = CountingTokenizer(tok)
    ds = StreamedDataset(DataSpec(big, seq=32), counting, shuffle_buffer=0)
    stream = StreamedBatches(ds, 4, readers=1)
    head = counting.texts  # the first rows, checked on construction
    for _ in range(3):
        next(stream)
    used = stream.progress()["documents"]
    reader = stream.own[0]
    assert counting.texts - head == reader.docs.tokenized <= used + READ_AHEAD
    assert head <= 32 and counting.texts < len(many) / 20
    assert reader.lines.bytes_read < big.stat().st_size / 20


def test_streaming_rule_and_errors(files, tmp_path, monkeypatch):
    root, tok, _ = files
    spec = DataSpec(root / "docs.jsonl")
    assert not use_streaming(spec, "auto") and use_streaming(spec, "on") and not use_streaming(spec, "off")
    monkeypatch.setattr(S, "STREAM_ABOVE", 1000)
    assert use_streaming(spec, "auto")  # a file over the threshold is streamed
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}]))
    assert not use_streaming(DataSpec(array), "auto")  # a JSON array is read whole
    with pytest.raises(PlanError, match="not JSON lines.*\n.*--streaming off"):
        use_streaming(DataSpec(array), "on")
    import datasets

    datasets.Dataset.from_list([{"text": "a"}]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(PlanError, match="parquet files are read whole"):
        StreamedDataset(DataSpec(tmp_path / "t.parquet"), tok)
    bom = tmp_path / "bom.jsonl"  # a byte-order mark, as datasets reads it
    bom.write_bytes(b"\xef\xbb\xbf" + (root / "docs.jsonl").read_bytes())
    assert use_streaming(DataSpec(bom), "on")
    first = next(StreamedBatches(StreamedDataset(DataSpec(bom, seq=8), tok, shuffle_buffer=0), 2))
    assert _equal(first, next(Batches(TokenDataset(DataSpec(bom, seq=8), tok), 2, shuffle=False)))
    # the first rows are checked on construction: a missing field, chat without a template
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"body": f"note {i}"}) + "\n" for i in range(8)))
    with pytest.raises(PlanError, match=r"(?s)line 1 has no text field 'text'.*'body'.*--field"):
        StreamedDataset(DataSpec(notes), tok)
    plain = load_tokenizer(root / "model")
    plain.chat_template = None
    with pytest.raises(PlanError, match="chat template"):
        StreamedDataset(DataSpec(CHAT_FILE), plain)
    with pytest.raises(PlanError, match="max_position_embeddings"):
        StreamedDataset(DataSpec(root / "docs.jsonl", seq=256), tok, max_positions=128)
    # a bad row further on: raised when its reader meets it, naming the file, the line and the reader
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": t}) for t in texts(100)]
    lines[80] = '{"text": "unterminated'
    bad.write_text("\n".join(lines) + "\n")
    offset = sum(len(x) + 1 for x in lines[:80])
    stream = StreamedBatches(StreamedDataset(DataSpec(bad, seq=16), tok), 2, readers=1)
    with pytest.raises(PlanError, match=rf"(?s)bad.jsonl: the line at byte {offset} is not valid JSON.*reader 0 of 1"):
        for _ in range(200):
            next(stream)
    # a file too small for the readers' shares: one clear error, not an endless loop of empty epochs
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text(json.dumps({"text": "a b"}) + "\n")
    with pytest.raises(PlanError, match="make no global batch"):
        next(StreamedBatches(StreamedDataset(DataSpec(tiny, seq=16), tok), 4, readers=2))
