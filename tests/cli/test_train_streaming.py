"""``fxpar train --streaming on`` on 4 gloo ranks: each rank reads and tokenizes only its share of the file,
every rank holds the same global batches (those of one process running the 4 readers), a bad row far
into the file stops every rank with its message instead of a hang, and a run resumed from a checkpoint
taken mid-epoch (mid-document, with a full shuffle buffer) has the uninterrupted run's losses exactly."""

from __future__ import annotations

import argparse
import json

import pytest

from fxpar.testing import multiproc
from fxpar.testing.hfdir import make_model_dir

pool4 = multiproc.rank_pool(4)
WORDS = "the capital of France is Paris and one plus eight is nine while grass is green".split()


def texts(n: int) -> list[str]:
    return [f"doc {i}: " + " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + (i * 5) % 28)) for i in range(n)]


class CountingTokenizer:
    """The tokenizer, counting the texts it encodes."""

    def __init__(self, tok):
        self.tok, self.texts = tok, 0

    def __call__(self, texts, **kw):
        self.texts += len(texts)
        return self.tok(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    model = make_model_dir(root / "model", "llama")
    small = root / "small.jsonl"  # a few batches per epoch: the 6-step run below crosses an epoch
    small.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(24)))
    big = root / "big.jsonl"
    big.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(6000)))
    return root, model, small, big


def _batches(model, path: str, steps: int, readers: int | None = None) -> dict:
    """``steps`` global batches of 8 rows read by this rank's readers, what it tokenized and read."""
    from fxpar.data import DataSpec, StreamedBatches, StreamedDataset, load_tokenizer

    tok = CountingTokenizer(load_tokenizer(model))
    ds = StreamedDataset(DataSpec(path, seq=32), tok, max_positions=128, shuffle_buffer=64)
    head = tok.texts
    stream = StreamedBatches(ds, 8, seed=3, readers=readers)
    out = [next(stream) for _ in range(steps)]
    return {"batches": out, "tokenized": tok.texts - head,
            "bytes": sum(r.lines.bytes_read for r in stream.own.values()),
            "own": sorted(stream.own), "state": stream.state_dict()}


def _eval_rows(model, path: str) -> list[dict]:
    """The streamed evaluation batches of 6 padded rows, on this rank."""
    from fxpar.data import DataSpec, StreamedDataset, eval_batches, load_tokenizer

    return list(eval_batches(StreamedDataset(DataSpec(path, seq=128, pack=False), load_tokenizer(model)), 6))


def _bad_row(model, path: str) -> str:
    from fxpar.data import DataSpec, StreamedBatches, StreamedDataset, load_tokenizer
    from fxpar.ir.errors import PlanError

    stream = StreamedBatches(StreamedDataset(DataSpec(path, seq=32), load_tokenizer(model), shuffle_buffer=0), 8)
    try:
        for _ in range(1000):
            next(stream)
    except PlanError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_each_rank_reads_its_share_and_all_hold_the_same_batches(pool4, setup):
    root, model, _, big = setup
    got = pool4.run(_batches, str(model), str(big), 3)
    one = _batches(str(model), str(big), 3, readers=4)  # one process running all 4 readers
    assert [g["own"] for g in got] == [[0], [1], [2], [3]] and one["own"] == [0, 1, 2, 3]
    for g in got:
        assert all(a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
                   for a, b in zip(g["batches"], one["batches"]))
        assert g["state"] == one["state"]  # every rank knows every reader's position
    size, docs = big.stat().st_size, 6000
    for rank, g in enumerate(got):
        taken = g["state"]["positions"][rank]["documents"]  # documents its reader put into rows
        print(f"rank {rank}: tokenized {g['tokenized']} of {docs} documents ({taken} in rows), "
              f"read {g['bytes']} of {size} bytes")
        assert taken <= g["tokenized"] <= taken + 64 + 64  # + the shuffle buffer's fill and one read-ahead
        assert g["tokenized"] < docs / 20 and g["bytes"] < size / 20
    assert sum(g["tokenized"] for g in got) == one["tokenized"]  # no row tokenized twice across ranks
    # evaluation: the same batches on every rank, each document once over the readers, the rest filler
    small = root / "small.jsonl"
    evals = pool4.run(_eval_rows, str(model), str(small))
    assert all(len(e) == len(evals[0]) and all((a[k] == b[k]).all() for a, b in zip(e, evals[0]) for k in a)
               for e in evals)
    from fxpar.data import DataSpec, TokenDataset, load_tokenizer

    whole = TokenDataset(DataSpec(small, seq=128, pack=False), load_tokenizer(model))
    rows = sorted(tuple(r[m == 1].tolist()) for b in evals[0] for r, m in zip(b["input_ids"], b["attention_mask"])
                  if m.any())
    assert rows == sorted(tuple(r[m == 1].tolist()) for r, m in zip(whole.take(range(len(whole)))["input_ids"],
                                                                   whole.take(range(len(whole)))["attention_mask"]))
    # a bad row far into the file: every rank raises its message (naming the rank that read it)
    bad = root / "bad.jsonl"
    lines = [json.dumps({"text": t}) for t in texts(400)]
    lines[300] = '{"text": 7}'
    bad.write_text("\n".join(lines) + "\n")
    errors = pool4.run(_bad_row, str(model), str(bad), timeout=120)
    assert len(set(errors)) == 1 and "field 'text' is a int, not a string" in errors[0], errors
    assert "the line at byte" in errors[0] and "on rank" in errors[0]


def _train(argv: list[str]) -> dict:
    """``fxpar train argv``; with ``--resume``, whether the restored data position is the saved one."""
    from fxpar import checkpoint
    from fxpar.cli import train
    from fxpar.train.loop import FineTune

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    run = FineTune(args)
    saved = checkpoint.info(checkpoint.latest(args.resume))["extra"]["data"] if args.resume else None
    kind = run.stream.state_dict()["kind"]
    losses = run.run()
    return {"losses": losses, "data_equal": saved == run.data_start if saved else None, "kind": kind,
            "epoch": run.stream.batches.epoch, "evals": [e["eval_loss"] for e in run.evals]}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_streamed_training_resumes_mid_epoch_with_the_same_losses(pool4, setup, tmp_path):
    _, model, small, _ = setup
    argv = [str(model), "--plan", "dp=2,tp=2", "--data", str(small), "--streaming", "on", "--shuffle-buffer", "3",
            "--seq", "16", "--batch", "8", "--grad-accum", "2", "--steps", "6", "--lr", "3e-3", "--seed", "1",
            "--eval-data", str(small), "--eval-every", "-1"]
    ckpt, metrics = str(tmp_path / "ckpt"), tmp_path / "metrics.jsonl"
    whole = pool4.run(_train, argv + ["--save", ckpt, "--save-every", "3", "--metrics-out", str(metrics)])
    assert all(w["kind"] == "streamed" and w["losses"] == whole[0]["losses"] for w in whole)
    counts = [(r["data_documents"], r["data_tokens"]) for r in map(json.loads, metrics.read_text().splitlines())
              if "loss" in r]  # what the readers have taken so far, for the metrics
    assert len(counts) == 6 and counts == sorted(counts) and counts[0][0] > 0 and counts[-1][1] >= 6 * 16 * 16
    assert whole[0]["epoch"] >= 1, "the run should cross an epoch boundary"
    (tmp_path / "ckpt" / "latest").write_text("step_00000003\n")  # it also saved at 6
    from fxpar import checkpoint

    state = checkpoint.info(checkpoint.latest(ckpt))["extra"]["data"]
    print(f"saved at step 3 in epoch {state['epoch']}, the run ends in epoch {whole[0]['epoch']}")
    assert state["kind"] == "streamed" and state["readers"] == 4 and state["epoch"] < whole[0]["epoch"]
    assert any(p["doc"] is not None for p in state["positions"]) and all(p["buffer"] for p in state["positions"])
    resumed = pool4.run(_train, argv + ["--resume", ckpt])
    print("uninterrupted:", whole[0]["losses"], "\nresumed at 3:", resumed[0]["losses"])
    assert all(r["data_equal"] for r in resumed)
    assert resumed[0]["losses"] == whole[0]["losses"][3:]  # exactly
    # the streamed evaluation file: the same loss at the end of both runs, lower than before training
    assert resumed[0]["evals"][-1] == whole[0]["evals"][-1] < whole[0]["evals"][0]


def test_bad_streamed_data_fails_before_any_communication(setup, tmp_path, monkeypatch, capsys):
    """A streamed file's first rows are checked before the process group is joined (exit code 2)."""
    import fxpar.launch
    from fxpar.cli import train

    def trap(*a, **k):
        raise AssertionError("init_distributed was reached: the error came after communication could start")

    monkeypatch.setattr(fxpar.launch, "init_distributed", trap)
    _, model, _, _ = setup
    notes = tmp_path / "notes.jsonl"
    notes.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts(50)))
    assert train.main([str(model), "--data", str(notes), "--streaming", "on"]) == 2
    err = capsys.readouterr().err
    assert str(notes) in err and "line 1 has no text field 'text'" in err and "--field" in err
    array = tmp_path / "array.json"  # not JSON lines: --streaming on says why it cannot stream it
    array.write_text(json.dumps([{"text": t} for t in texts(50)]))
    assert train.main([str(model), "--data", str(array), "--streaming", "on"]) == 2
    err = capsys.readouterr().err
    assert "cannot stream it: the file is not JSON lines" in err and "--streaming off" in err
