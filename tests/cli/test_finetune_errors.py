"""``fxpar train`` refuses bad input with one clear message before any rank communicates: the process
group is never joined (``init_distributed`` is replaced by a trap here), the exit code is 2."""

from __future__ import annotations

import json
import shutil

import pytest

from fxpar.testing.hfdir import CHAT_FILE


def _train(argv, capsys) -> str:
    from fxpar.cli import train

    assert train.main(argv) == 2
    return capsys.readouterr().err


def test_directory_without_weights(tmp_path, model_dir, no_communication, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / f, bare / f)
    err = _train([str(bare), "--data", str(CHAT_FILE)], capsys)
    assert f"model directory {bare} has no weights" in err and "save_pretrained" in err


def test_dataset_without_the_named_field(tmp_path, model_dir, no_communication, capsys):
    data = tmp_path / "notes.jsonl"
    data.write_text("\n".join(json.dumps({"body": f"note {i}"}) for i in range(8)) + "\n")
    err = _train([str(model_dir), "--data", str(data), "--format", "json"], capsys)
    assert str(data) in err and "text" in err and "body" in err and "--field" in err


def test_chat_file_for_a_tokenizer_without_a_chat_template(tmp_path, model_dir, no_communication, capsys):
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    err = _train([str(plain), "--data", str(CHAT_FILE)], capsys)
    assert "chat template" in err and str(CHAT_FILE) in err


def test_sequence_longer_than_the_model_allows(model_dir, no_communication, capsys):
    err = _train([str(model_dir), "--data", str(CHAT_FILE), "--seq", "256"], capsys)
    assert "256" in err and "128" in err  # the tiny checkpoint has 128 positions


def test_bad_schedule_and_accumulation(model_dir, no_communication, capsys):
    assert "--grad-accum 0" in _train([str(model_dir), "--data", "synthetic", "--grad-accum", "0"], capsys)
    err = _train([str(model_dir), "--data", "synthetic", "--lr-scheduler", "cosine_wobble"], capsys)
    assert "cosine_wobble" in err and "cosine" in err


@pytest.mark.parametrize("flag,value,said", [("--lr", "nan", "--lr nan"),
                                             ("--weight-decay=-0.5", None, "--weight-decay -0.5"),
                                             ("--batch", "0", "--batch 0"), ("--seq", "0", "--seq 0"),
                                             ("--max-grad-norm", "0", "--max-grad-norm 0.0")])
def test_numbers_out_of_range(model_dir, no_communication, capsys, flag, value, said):
    err = _train([str(model_dir), "--data", "synthetic", flag] + ([value] if value is not None else []), capsys)
    assert said in err and "give" in err


def test_plan_the_launch_world_does_not_fit(model_dir, no_communication, capsys, monkeypatch):
    """Under torchrun (WORLD_SIZE) a plan for another number of ranks is refused before the group is joined:
    no rank is left waiting in a half-formed group."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _train([str(model_dir), "--data", "synthetic", "--plan", "tp=3"], capsys)
    assert "needs 3 ranks" in err and "the world has 2" in err


@pytest.mark.parametrize("argv,words", [
    (["--lora", "r=0"], ["--lora 'r=0': not a LoRA rank", "--lora r=16"]),
    (["--lora", "rank=16"], ["--lora 'rank=16': not a LoRA rank"]),
    (["--lora-alpha", "16"], ["--lora-alpha without --lora"]),
    (["--lora", "r=4", "--lora-dropout", "1.5"], ["--lora-dropout 1.5: give a probability in [0, 1)"]),
    (["--lora", "r=4", "--merge"], ["--merge without --export"]),
    (["--lora", "r=4", "--lora-targets", "qproj"], ["--lora-targets qproj", "qproj", "q_proj, k_proj, v_proj"]),
])
def test_bad_lora_options(model_dir, no_communication, capsys, argv, words):
    err = _train([str(model_dir), "--data", str(CHAT_FILE), *argv], capsys)
    assert all(w in err for w in words), err


def test_lora_on_a_model_type_peft_has_no_targets_for(no_communication, capsys):
    err = _train(["olmo", "--data", "synthetic", "--lora", "r=4"], capsys)
    for words in ("no default target modules for model type 'olmo'", "q_proj, k_proj, v_proj, o_proj",
                  "--lora-targets q_proj,k_proj"):
        assert words in err, err
