"""fxpar.data against references computed here from the tokenizer itself: packed windows (position ids,
boundary labels), padded rows, chat labels on exactly the assistant's tokens (with and without
``{% generation %}`` markers), parquet = JSON lines, the resumable order, evaluation batches covering
each sample once, each data error's message, and a packed batch's loss equal to its documents' losses."""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch

from fxpar.data import IGNORE, Batches, DataSpec, TokenDataset, eval_batches, load_tokenizer
from fxpar.data.encode import prefix_mask
from fxpar.ir.errors import PlanError
from fxpar.testing.hfdir import CHAT_TEMPLATE, make_model_dir

TEXTS = ["The capital of France is Paris.", "One plus eight is nine.", "The blood is red.",
         "What is three plus one? It is four, and four is even.", "Answer in one short sentence.",
         "Grass is green and the sky is blue.", "Ten minus two is eight."]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer in one short sentence."},
     {"role": "user", "content": "What is 1 plus 8?"}, {"role": "assistant", "content": "1 plus 8 is 9."},
     {"role": "user", "content": "And 2 plus 2?"}, {"role": "assistant", "content": "2 plus 2 is 4."}],
    [{"role": "user", "content": "What colour is the blood?"}, {"role": "assistant", "content": "It is red."}],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    model = make_model_dir(root / "model", "llama")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    (root / "docs.txt").write_text("\n\n".join(TEXTS) + "\n")
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    import datasets

    datasets.Dataset.from_list([{"text": t, "id": i} for i, t in enumerate(TEXTS)]).to_parquet(
        str(root / "docs.parquet"))
    datasets.Dataset.from_list([{"messages": m} for m in CHATS]).to_parquet(str(root / "chat.parquet"))
    return root, model, load_tokenizer(model)


def encoded(tok, texts):
    """tokenizer(text) + EOS per text: the documents as the module must see them."""
    return [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]


def test_packing_windows_positions_and_boundary_labels(files):
    root, _, tok = files
    seq = 12
    ds = TokenDataset(DataSpec(root / "docs.jsonl", seq=seq), tok, max_positions=128)
    docs = encoded(tok, TEXTS)
    flat = [t for d in docs for t in d]
    pos = [p for d in docs for p in range(len(d))]
    starts = {sum(map(len, docs[:k])) for k in range(len(docs))}
    n = len(flat) // seq
    assert ds.kind == "text" and len(ds) == n and n >= 3 and ds.keys == ("input_ids", "labels", "position_ids")
    for i in range(n):
        s = ds[i]
        span = range(i * seq, (i + 1) * seq)
        assert s["input_ids"].tolist() == flat[i * seq:(i + 1) * seq]
        assert s["position_ids"].tolist() == pos[i * seq:(i + 1) * seq]  # a continued document keeps counting
        assert s["labels"].tolist() == [IGNORE if j in starts else flat[j] for j in span]
    assert any(ds[i]["position_ids"][0] > 0 for i in range(n))  # some window starts inside a document
    # the same texts as a plain-text file (blank lines skipped) and without position ids
    txt = TokenDataset(DataSpec(root / "docs.txt", seq=seq), tok, position_ids=False)
    assert txt.keys == ("input_ids", "labels") and txt.documents == len(TEXTS)
    assert torch.equal(txt.take(range(n))["labels"], ds.take(range(n))["labels"])
    # positions wrap at the model's maximum instead of running past it
    wrapped = TokenDataset(DataSpec(root / "docs.jsonl", seq=seq), tok, max_positions=seq)
    assert int(wrapped.take(range(n))["position_ids"].max()) < seq


def test_padding_rows_masks_and_truncation(files):
    root, _, tok = files
    docs = encoded(tok, TEXTS)
    seq = 10
    with pytest.warns(UserWarning, match=rf"{sum(len(d) > seq for d in docs)} of {len(TEXTS)} documents"):
        ds = TokenDataset(DataSpec(root / "docs.jsonl", seq=seq, pack=False), tok)
    assert len(ds) == len(TEXTS) and ds.keys == ("input_ids", "labels", "attention_mask")
    for i, d in enumerate(docs):
        s, k = ds[i], min(len(d), seq)
        assert s["input_ids"].tolist() == d[:k] + [tok.pad_token_id] * (seq - k)
        assert s["attention_mask"].tolist() == [1] * k + [0] * (seq - k)
        assert s["labels"].tolist() == d[:k] + [IGNORE] * (seq - k)


def assistant_text(messages, eos):
    return "".join(m["content"] + eos for m in messages if m["role"] == "assistant")


def test_chat_labels_are_the_assistant_tokens(files):
    root, _, tok = files
    ds = TokenDataset(DataSpec(root / "chat.jsonl", seq=64, pack=False), tok)
    assert ds.kind == "chat" and len(ds) == len(CHATS) and ds.truncated == 0
    for i, messages in enumerate(CHATS):
        s = ds[i]
        ids = s["input_ids"][s["attention_mask"] == 1]
        assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
        labelled = s["labels"][s["labels"] != IGNORE]
        assert tok.decode(labelled) == assistant_text(messages, tok.eos_token)
    packed = TokenDataset(DataSpec(root / "chat.jsonl", seq=16), tok)
    labels = packed.take(range(len(packed)))["labels"].flatten()
    kept = sum(len(tok(assistant_text(m, tok.eos_token))["input_ids"]) for m in CHATS)
    assert 0 < int((labels != IGNORE).sum()) <= kept


def test_prefix_rule_equals_generation_markers(files):
    root, model, tok = files
    plain = load_tokenizer(model)
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    spec = DataSpec(root / "chat.jsonl", seq=16)
    marked, fallback = TokenDataset(spec, tok), TokenDataset(spec, plain)
    for k in marked.keys:
        assert torch.equal(marked.take(range(len(marked)))[k], fallback.take(range(len(fallback)))[k])
    for messages in CHATS:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert prefix_mask(plain, messages, "chat") == (list(enc["input_ids"]), list(enc["assistant_masks"]))
    # a template that renders a turn differently once the conversation goes on: a clear error
    plain.chat_template = plain.chat_template.replace("{{ m['content'] }}{{ eos_token }}",
                                                      "{% if loop.last %}Last: {% endif %}"
                                                      "{{ m['content'] }}{{ eos_token }}")
    with pytest.raises(PlanError, match=r"(?s)chat.jsonl.*row 2.*assistant.*generation"):
        TokenDataset(spec, plain)


def _truncation_warning(expected: bool):
    return pytest.warns(UserWarning, match="longer than seq=16 tokens and were truncated") if expected \
        else contextlib.nullcontext()


def test_parquet_equals_jsonl(files):
    root, _, tok = files
    for a, b in (("docs.jsonl", "docs.parquet"), ("chat.jsonl", "chat.parquet")):
        for pack in (True, False):
            # unpacked, some documents of these files are longer than 16 tokens: both formats cut them, and say so
            with _truncation_warning(not pack):
                x = TokenDataset(DataSpec(root / a, seq=16, pack=pack), tok)
            with _truncation_warning(not pack):
                y = TokenDataset(DataSpec(root / b, seq=16, pack=pack), tok)
            assert x.kind == y.kind and len(x) == len(y) and x.keys == y.keys
            for k in x.keys:
                assert torch.equal(x.take(range(len(x)))[k], y.take(range(len(y)))[k]), (a, pack, k)


def test_batches_order_and_resume_across_epochs(files):
    root, _, tok = files
    ds = TokenDataset(DataSpec(root / "docs.jsonl", seq=4), tok)
    n, batch = len(ds), 4
    assert n % batch  # a remainder, dropped each epoch
    per_epoch = n // batch
    first = Batches(ds, batch, seed=7)
    ids = [next(first)["input_ids"] for _ in range(2 * per_epoch)]
    again = Batches(ds, batch, seed=7)
    assert all(torch.equal(a, next(again)["input_ids"]) for a in ids)  # deterministic
    rows = {tuple(r) for r in ds.take(range(n))["input_ids"].tolist()}
    assert len(rows) == n
    for e in range(2):  # each epoch: distinct samples of the dataset, in another order
        taken = [tuple(r) for b in ids[e * per_epoch:(e + 1) * per_epoch] for r in b.tolist()]
        assert len(set(taken)) == per_epoch * batch and set(taken) <= rows
    assert not torch.equal(torch.cat(ids[:per_epoch]), torch.cat(ids[per_epoch:]))
    other = Batches(ds, batch, seed=8)
    assert not all(torch.equal(a, next(other)["input_ids"]) for a in ids[:per_epoch])
    plain = Batches(ds, batch, shuffle=False)
    assert torch.equal(next(plain)["input_ids"], ds.take(range(batch))["input_ids"])
    # resume: 5 batches (across the epoch boundary), save, a new iterator continues as the original
    run = Batches(ds, batch, seed=3)
    for _ in range(per_epoch + 2):
        next(run)
    state = json.loads(json.dumps(run.state_dict()))
    assert state["epoch"] == 1 and state["samples"] == n
    resumed = Batches(ds, batch, seed=0)
    resumed.load_state_dict(state)
    for _ in range(per_epoch + 1):
        a, b = next(run), next(resumed)
        assert all(torch.equal(a[k], b[k]) for k in ds.keys)
    short = TokenDataset(DataSpec(root / "docs.jsonl", seq=8), tok)
    with pytest.raises(PlanError, match=rf"{n} samples.*{len(short)}"):
        Batches(short, batch).load_state_dict(state)


def test_eval_batches_cover_each_sample_once(files):
    root, _, tok = files
    for pack in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = TokenDataset(DataSpec(root / "chat.jsonl" if pack else root / "docs.jsonl", seq=8, pack=pack), tok)
        batch = 2 if len(ds) % 2 else 3
        out = eval_batches(ds, batch)
        assert len(out) == -(-len(ds) // batch) and len(ds) % batch
        assert all(b[k].shape == (batch, 8) for b in out for k in ds.keys)
        assert sum(int((b["labels"] != IGNORE).sum()) for b in out) == ds.label_tokens > 0
        whole = {k: torch.cat([b[k] for b in out])[:len(ds)] for k in ds.keys}
        assert all(torch.equal(whole[k], ds.take(range(len(ds)))[k]) for k in ds.keys)
        tail = out[-1]["input_ids"][len(ds) % batch:]
        assert (tail == ds.pad_id).all() and (out[-1]["labels"][len(ds) % batch:] == IGNORE).all()
        if not pack:
            assert (out[-1]["attention_mask"][len(ds) % batch:] == 0).all()


def test_errors_name_the_file_the_numbers_and_the_fix(files, tmp_path):
    root, model, tok = files
    with pytest.raises(PlanError, match=r"nope.jsonl does not exist"):
        TokenDataset(DataSpec(root / "nope.jsonl"), tok)
    with pytest.raises(PlanError, match=r"(?s)docs.jsonl.*row 1.*'body'.*\['id', 'text'\].*--field"):
        TokenDataset(DataSpec(root / "docs.jsonl", field="body"), tok)
    bad = tmp_path / "holes.jsonl"
    bad.write_text('{"text": "a b c"}\n{"prompt": "d e"}\n')
    with pytest.raises(PlanError, match=r"(?s)holes.jsonl.*row 2.*'text'.*\['prompt'\].*--field"):
        TokenDataset(DataSpec(bad), tok)
    plain = load_tokenizer(model)
    plain.chat_template = None
    with pytest.raises(PlanError, match=r"(?s)chat.jsonl.*no chat_template.*chat template.*--field"):
        TokenDataset(DataSpec(root / "chat.jsonl"), plain)
    with pytest.raises(PlanError, match=r"seq=256.*max_position_embeddings=128"):
        TokenDataset(DataSpec(root / "docs.jsonl", seq=256), tok, max_positions=128)
    ds = TokenDataset(DataSpec(root / "docs.jsonl", seq=32), tok)
    with pytest.raises(PlanError, match=rf"{len(ds)} samples of seq=32 make no batch of {len(ds) + 1}"):
        Batches(ds, len(ds) + 1)
    with pytest.raises(PlanError, match=r"make no window of seq=1024"):
        TokenDataset(DataSpec(root / "docs.jsonl", seq=1024), tok)
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(PlanError, match=r"(?s)no tokenizer files.*save_pretrained"):
        load_tokenizer(empty)
    with pytest.raises(PlanError, match=r"unknown format 'csv'"):
        DataSpec(root / "docs.jsonl", format="csv")


def test_packed_batch_loss_equals_its_documents(files):
    """Position ids that restart per document make the HF model attend within documents: the packed
    loss equals the token-weighted loss of each document segment run alone with the same positions."""
    from transformers import AutoModelForCausalLM

    root, model_dir, tok = files
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.config.use_cache = False  # with a cache, transformers does not look for packed sequences
    ds = TokenDataset(DataSpec(root / "docs.jsonl", seq=24), tok)
    b = ds.take([0, 1])
    with torch.no_grad():
        packed = float(model(**b).loss)
        total, count = 0.0, 0
        for row in range(2):
            pos = b["position_ids"][row]
            cuts = [0] + [i for i in range(1, len(pos)) if pos[i] == 0] + [len(pos)]
            for lo, hi in zip(cuts, cuts[1:]):
                seg = {k: b[k][row:row + 1, lo:hi] for k in b}
                labels = seg["labels"][:, 1:]
                k = int((labels != IGNORE).sum())
                if k:
                    total += float(model(**seg).loss) * k
                    count += k
    assert len(cuts) > 2 and abs(packed - total / count) < 1e-5
