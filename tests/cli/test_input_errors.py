"""Inputs that cannot be read as given are named before any rank communicates: the weights of a model
directory (which of its N shards, what is wrong, in numbers), the data file (its line, the JSON error,
the field and the fields the row has, a fix that follows what the rows hold), the model argument (a
directory without config.json, a hub id, a typo) and ``inspect --module``. Every command runs in
process with ``init_distributed`` and ``init_process_group`` replaced by traps, and exits 2 with one
``fxpar:`` message."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from fxpar.testing.hfdir import CHAT_FILE


def _fxpar(argv, capsys) -> str:
    """``fxpar ARGV``'s stderr; it must exit 2 with one message (no traceback)."""
    from fxpar.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpar: ") and err.count("fxpar: ") == 1 and "Traceback" not in err, err
    return err


def _copy(model_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    return out


def _header(path) -> tuple[int, dict]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def _write_header(path, header: dict) -> None:
    raw = path.read_bytes()
    data = raw[8 + struct.unpack("<Q", raw[:8])[0]:]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


SHARD = "model-0000{}-of-00005.safetensors"
TRAIN = ["train", "--data", str(CHAT_FILE)]


# ---- weights ---------------------------------------------------------------------------------------

def test_truncated_shard_is_named_by_train_generate_and_compile(model_dir, tmp_path, no_communication, capsys,
                                                                 monkeypatch):
    import fxpar
    from fxpar.safetensors_check import check_directory
    from fxpar.train.models import load_model

    assert check_directory(model_dir) is None  # the intact directory passes
    bad = _copy(model_dir, tmp_path)
    shard = bad / SHARD.format(3)
    n, header = _header(shard)
    declared = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    shard.write_bytes(shard.read_bytes()[:8 + n + declared // 3])
    want = (f"weights: {shard} (shard 3 of 5): truncated: header says {declared:,} bytes of data, "
            f"file has {declared // 3:,}")
    for argv in ([*TRAIN[:1], str(bad), *TRAIN[1:]], ["generate", str(bad), "--prompt", "hi"]):
        err = _fxpar(argv, capsys)
        assert want in err and "fix: copy or download that file again" in err, err
    # compile(weights=dir) under torchrun checks the files before it joins the process group
    monkeypatch.setenv("WORLD_SIZE", "2")
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(fxpar.PlanError, match=r"shard 3 of 5\): truncated: header says"):
        fxpar.compile(load_model(str(bad)), "dp=2", example_kwargs={"input_ids": ids, "labels": ids}, weights=bad)


def test_a_file_that_is_not_safetensors_a_missing_shard_and_a_stale_index(model_dir, tmp_path, no_communication,
                                                                          capsys):
    bad = _copy(model_dir, tmp_path)
    generate = ["generate", str(bad), "--prompt", "hi"]
    (bad / SHARD.format(2)).write_bytes(b"PK\x03\x04" + b"\0" * 4096)  # a zip (torch.save) under the name
    err = _fxpar(generate, capsys)
    assert f"{bad / SHARD.format(2)} (shard 2 of 5): not a safetensors file" in err, err
    (bad / SHARD.format(2)).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 124136\n")
    assert "(shard 2 of 5): not a safetensors file but a Git LFS pointer" in _fxpar(generate, capsys)
    shutil.copy(model_dir / SHARD.format(2), bad / SHARD.format(2))
    (bad / SHARD.format(4)).unlink()
    err = _fxpar(["train", str(bad), "--data", str(CHAT_FILE)], capsys)
    assert f"{bad / SHARD.format(4)} (shard 4 of 5) is missing, listed in model.safetensors.index.json" in err, err
    shutil.copy(model_dir / SHARD.format(4), bad / SHARD.format(4))
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = SHARD.format(5)  # it lives in shard 1
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    err = _fxpar(generate, capsys)
    assert "places 1 tensor in" in err and "(shard 5 of 5), which does not hold it: model.embed_tokens.weight" in err


def test_unknown_dtype_names_the_tensor(model_dir, tmp_path, no_communication, capsys):
    bad = _copy(model_dir, tmp_path)
    shard = bad / SHARD.format(1)
    _, header = _header(shard)
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["dtype"] = "F12"
    _write_header(shard, header)
    err = _fxpar(["generate", str(bad), "--prompt", "hi"], capsys)
    assert f"(shard 1 of 5): tensor {name} has dtype 'F12', which this safetensors" in err, err


# ---- the model argument ----------------------------------------------------------------------------

def _every_command(model: str) -> list[list[str]]:
    return [["train", model, "--data", "synthetic"], ["generate", model, "--prompt", "hi"], ["plan", model],
            ["inspect", model]]


def test_directory_without_config_json(model_dir, tmp_path, no_communication, capsys):
    bare = _copy(model_dir, tmp_path)
    (bare / "config.json").unlink()
    for argv in _every_command(str(bare)):
        err = _fxpar(argv, capsys)
        assert f"model directory {bare} has no config.json (found: chat_template.jinja, " in err, (argv, err)
        assert "a save_pretrained directory holds config.json, the weights" in err and "save_pretrained(DIR)" in err
    outer = tmp_path / "outer"  # what a download leaves: the model one level down
    shutil.copytree(model_dir, outer / "snapshot")
    assert f"fix: pass {outer / 'snapshot'}, which holds config.json" in _fxpar(["plan", str(outer)], capsys)


def test_hub_id_says_how_to_make_a_local_directory(tmp_path, no_communication, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in _every_command("Qwen/Qwen2-0.5B"):
        err = _fxpar(argv, capsys)
        assert "model 'Qwen/Qwen2-0.5B' is no local path: it looks like a Hugging Face hub id" in err, (argv, err)
        assert "`hf download Qwen/Qwen2-0.5B --local-dir Qwen2-0.5B`" in err and "huggingface-cli download" in err
        assert "AutoModelForCausalLM.from_pretrained('Qwen/Qwen2-0.5B').save_pretrained('Qwen2-0.5B')" in err
    err = _fxpar(["train", "llama", "--data", str(CHAT_FILE), "--tokenizer", "Qwen/Qwen2-0.5B"], capsys)
    assert "tokenizer 'Qwen/Qwen2-0.5B' is no local path: it looks like a Hugging Face hub id" in err, err
    assert "`hf download Qwen/Qwen2-0.5B --local-dir Qwen2-0.5B`" in err


def test_neither_zoo_name_nor_path_lists_the_zoo(no_communication, capsys):
    from fxpar import zoo

    for argv in _every_command("lama"):
        err = _fxpar(argv, capsys)
        assert "model 'lama' is neither a zoo name nor an existing path" in err, (argv, err)
        assert "a zoo name: llama, " in err and all(n in err for n in zoo.ZOO_NAMES)


def test_inspect_module_typo_names_the_nearest(no_communication, capsys, monkeypatch):
    import fxpar

    def no_trace(*a, **k):
        raise AssertionError("traced: the typo was found only after tracing")

    monkeypatch.setattr(fxpar, "trace", no_trace)
    err = _fxpar(["inspect", "llama", "--module", "model.layers.0.self_atn"], capsys)
    assert "--module model.layers.0.self_atn: llama has no module 'model.layers.0.self_atn'" in err, err
    assert "the nearest: model.layers.0.self_attn" in err


# ---- data ------------------------------------------------------------------------------------------

@pytest.fixture(params=["off", "on"])
def streaming(request):
    return request.param


def _data(model_dir, path, streaming, capsys, *extra) -> str:
    return _fxpar(["train", str(model_dir), "--data", str(path), "--streaming", streaming, *extra], capsys)


def test_empty_file_and_broken_json_line(model_dir, tmp_path, streaming, no_communication, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"data {empty}: the file is empty (0 bytes)" in _data(model_dir, empty, streaming, capsys)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three\n{"text": "four"}\n')
    err = _data(model_dir, broken, streaming, capsys)
    assert f"data {broken}: line 4 is not valid JSON: Unterminated string starting at column 10" in err, err
    assert "fix: fix or remove line 4" in err


def test_row_without_the_field(model_dir, tmp_path, streaming, no_communication, capsys):
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"text": "one"}\n\n{"text": "two"}\n{"body": "three", "id": 3}\n')
    err = _data(model_dir, notes, streaming, capsys)
    row = "row 3 (line 4)" if streaming == "off" else "line 4"
    assert f"data {notes}: {row} has no text field 'text'; its fields: ['body', 'id']" in err, err
    assert "fix: its text is in 'body': --field body" in err


def test_chat_rows_under_another_key_hint_messages_field(model_dir, tmp_path, streaming, no_communication, capsys):
    rows = [json.loads(line) for line in CHAT_FILE.read_text().splitlines() if line.strip()]
    chat = tmp_path / "conv.jsonl"
    chat.write_text("".join(json.dumps({"conversation": r["messages"], "id": i}) + "\n" for i, r in enumerate(rows)))
    err = _data(model_dir, chat, streaming, capsys)
    assert "has no text field 'text'; its fields: ['conversation', 'id']" in err, err
    assert "--messages-field conversation" in err and "--field conversation" not in err
    # the hint works: the run gets as far as communicating
    with pytest.raises(AssertionError, match="a process group was joined"):
        _data(model_dir, chat, streaming, capsys, "--messages-field", "conversation")
    text_field = tmp_path / "texts.jsonl"  # a conversation where a text is expected: the same hint
    text_field.write_text("".join(json.dumps({"text": r["messages"]}) + "\n" for r in rows))
    err = _data(model_dir, text_field, streaming, capsys)
    assert "field 'text' is a list, not a string" in err and "--messages-field text" in err, err
