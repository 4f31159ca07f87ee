"""``fxpar train`` does nothing silently: no ``--data`` is an error (``--data synthetic`` says it trains on
random tokens); ``--resume`` takes a ``step_N`` checkpoint or a directory's latest and says what it resumed
from, and a path without a checkpoint is an error; ``--save`` alone saves at the end, ``--save-every``
always includes the last step, ``--save-total-limit`` prunes; a checkpoint the OS refuses to write is one
message naming the file and the reason; the progress line carries tokens, epoch, elapsed time and ETA.

Bad options are refused before any rank communicates (``init_distributed`` is replaced by a trap); the
behaviour is checked on one-process runs of the zoo's tiny llama (about a second each) and, for the write
failure of one rank of two, on 2 gloo ranks."""

from __future__ import annotations

import errno
import json
import os
import re

import pytest

from fxpar.testing import multiproc

TINY = ["llama", "--batch", "2", "--seq", "8", "--lr", "1e-2"]  # 16 tokens a step
pool2 = multiproc.rank_pool(2, shared=True)


def _refused(argv, capsys) -> str:
    from fxpar.cli import train

    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpar: ") and err.count("\n") == 1, err  # one line
    return err


def _run(argv, capsys) -> str:
    from fxpar.cli import train

    assert train.main(argv) == 0
    return capsys.readouterr().out


def _records(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _steps(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "latest")


# ---- errors, before any communication --------------------------------------------------------------

def test_no_data_is_an_error_naming_both_fixes(no_communication, capsys):
    err = _refused(TINY + ["--steps", "2"], capsys)
    assert "no --data given" in err and "--data FILE" in err and "--data synthetic" in err


def test_bad_resume_paths(tmp_path, no_communication, capsys):
    missing = tmp_path / "ckpt" / "step_00000009"
    err = _refused(TINY + ["--data", "synthetic", "--resume", str(missing)], capsys)
    assert f"--resume {missing}: no such file or directory" in err
    empty = tmp_path / "empty"
    (empty / "step_00000004.partial").mkdir(parents=True)  # an interrupted save is not a checkpoint
    err = _refused(TINY + ["--data", "synthetic", "--resume", str(empty)], capsys)
    assert f"{empty} holds no complete fxpar checkpoint" in err and "fxpar.json" in err and "'latest'" in err
    assert "step_00000004.partial never finished" in err
    # the directory --save will write, before its first checkpoint: --resume auto is the form for that
    err = _refused(TINY + ["--data", "synthetic", "--save", str(tmp_path / "new"), "--resume", str(tmp_path / "new")],
                   capsys)
    assert "no such file or directory" in err and "--resume auto" in err
    err = _refused(TINY + ["--data", "synthetic", "--resume", "auto"], capsys)
    assert "--resume auto" in err and "--save DIR" in err
    ahead = tmp_path / "ahead" / "step_00000009"  # a checkpoint past --steps
    ahead.mkdir(parents=True)
    (ahead / "fxpar.json").write_text(json.dumps({"format": 2, "step": 9, "extra": {}}))
    err = _refused(TINY + ["--data", "synthetic", "--steps", "5", "--resume", str(ahead.parent)], capsys)
    assert "at step 9, past --steps 5" in err and "--steps 9" in err


def test_bad_save_options(tmp_path, no_communication, capsys):
    save = ["--data", "synthetic", "--save", str(tmp_path / "ckpt")]
    err = _refused(TINY + ["--data", "synthetic", "--save-every", "2"], capsys)
    assert "--save-every 2 without --save" in err and "--save DIR" in err
    err = _refused(TINY + ["--data", "synthetic", "--save-total-limit", "2"], capsys)
    assert "--save-total-limit 2 without --save" in err
    assert "--save-total-limit 0: keep at least 1" in _refused(TINY + save + ["--save-total-limit", "0"], capsys)
    assert "--save-every -1" in _refused(TINY + save + ["--save-every", "-1"], capsys)
    assert "--log-every 0" in _refused(TINY + ["--data", "synthetic", "--log-every", "0"], capsys)
    afile = tmp_path / "notes.txt"
    afile.write_text("a file, not a directory")
    err = _refused(TINY + ["--data", "synthetic", "--save", str(afile / "ckpt")], capsys)
    assert f"--save {afile / 'ckpt'}: cannot write there: Not a directory" in err
    err = _refused(TINY + ["--data", "synthetic", "--export", str(afile)], capsys)
    assert f"--export {afile}: cannot write there" in err


def test_resume_finds_a_step_directory_or_a_directory_latest(tmp_path):
    from fxpar.train.saving import find, prune

    ckpt = tmp_path / "ckpt"
    for n in (1, 2, 3, 4, 5):
        (ckpt / f"step_{n:08d}").mkdir(parents=True)
        (ckpt / f"step_{n:08d}" / "fxpar.json").write_text(json.dumps({"step": n}))
    (ckpt / "step_00000006").mkdir()  # no fxpar.json: not complete
    (ckpt / "step_00000007.partial").mkdir()
    assert find(ckpt / "step_00000003") == ckpt / "step_00000003"
    assert find(ckpt) == ckpt / "step_00000005"  # no 'latest' file: the highest complete step
    (ckpt / "latest").write_text("step_00000002\n")
    assert find(ckpt) == ckpt / "step_00000002"
    removed = prune(ckpt, 2)  # the two newest, and the one 'latest' names
    assert [p.name for p in removed] == ["step_00000001", "step_00000003"]
    assert _steps(ckpt) == ["step_00000002", "step_00000004", "step_00000005", "step_00000006",
                            "step_00000007.partial"]


# ---- behaviour: one-process runs ---------------------------------------------------------------------

def test_synthetic_banner_saves_and_progress(tmp_path, capsys):
    """--data synthetic says so (and again on export); --save-every 2 of 5 steps saves 2, 4 and the last;
    --save-total-limit 2 keeps two; the progress line and the records carry tokens, times and no epoch."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    out = _run(TINY + ["--data", "synthetic", "--steps", "5", "--save", str(ckpt), "--save-every", "2",
                       "--save-total-limit", "2", "--export", str(tmp_path / "hf"), "--metrics-out", str(metrics),
                       "--max-grad-norm", "1.0", "--losses-out", str(tmp_path / "losses")], capsys)
    print(out)
    assert "this run trains on random tokens (--data synthetic)" in out.splitlines()[0]
    assert "its weights were trained on random tokens (--data synthetic)" in out
    assert re.findall(r"^saved \S+/(step_\d+)", out, re.M) == ["step_00000002", "step_00000004", "step_00000005"]
    assert "removed step_00000002: --save-total-limit 2" in out
    assert _steps(ckpt) == ["step_00000004", "step_00000005"] and (ckpt / "latest").read_text() == "step_00000005\n"
    lines = re.findall(r"^\[[#.]{20}\] step .*$", out, re.M)
    assert len(lines) == 5
    assert re.fullmatch(r"\[#{8}\.{12}\] step 2/5  loss \d+\.\d{4}  lr 0\.01  grad norm \d+\.\d{4}  [\d,]+ tok/s  "
                        r"tokens 32  elapsed \d:\d\d:\d\d  eta \d:\d\d:\d\d  mem/rank \d+\.\d MiB", lines[1]), lines[1]
    records = _records(metrics)
    assert [r["tokens_seen"] for r in records] == [16, 32, 48, 64, 80]
    assert all("epoch" not in r for r in records)  # random tokens have no epochs
    times = [r["elapsed_s"] for r in records]
    assert times == sorted(times) and records[-1]["eta_s"] == 0
    assert all(r["eta_s"] == pytest.approx(r["elapsed_s"] / r["step"] * (5 - r["step"])) for r in records)


def test_resume_from_a_step_directory_and_save_at_the_end(tmp_path, capsys):
    """Resumed from step_00000002 although 'latest' names step 4: its steps 3-4 are the first run's
    exactly, it says where it resumed, counts tokens on from the checkpoint, and --save without
    --save-every writes the last step only."""
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    _run(TINY + ["--data", "synthetic", "--steps", "4", "--save", str(ckpt), "--save-every", "2",
                 "--losses-out", str(tmp_path / "first")], capsys)
    assert _steps(ckpt) == ["step_00000002", "step_00000004"]
    out = _run(TINY + ["--data", "synthetic", "--steps", "4", "--resume", str(ckpt / "step_00000002"),
                       "--save", str(again), "--losses-out", str(tmp_path / "second"),
                       "--metrics-out", str(tmp_path / "m.jsonl")], capsys)
    assert out.splitlines()[0] == f"resuming from {ckpt / 'step_00000002'} (step 2)"
    first = (tmp_path / "first").read_text().split()
    assert (tmp_path / "second").read_text().split() == first[2:]
    assert [r["tokens_seen"] for r in _records(tmp_path / "m.jsonl")] == [48, 64]
    assert _steps(again) == ["step_00000004"]
    out = _run(TINY + ["--data", "synthetic", "--steps", "4", "--save", str(tmp_path / "fresh"), "--resume", "auto"],
               capsys)
    assert f"--resume auto: no checkpoint in {tmp_path / 'fresh'} yet: starting at step 0" in out
    assert _steps(tmp_path / "fresh") == ["step_00000004"]


def test_epoch_as_a_fraction_of_a_data_file(tmp_path, capsys):
    """12 one-line documents, unpacked, batch 4: 3 steps an epoch; the records say 1/3, 2/3, 1, 4/3."""
    from fxpar.testing.hfdir import make_model_dir

    model = make_model_dir(tmp_path / "model", "llama")
    data = tmp_path / "notes.txt"
    data.write_text("".join(f"note number {i}\n" for i in range(12)))
    out = _run([str(model), "--data", str(data), "--no-pack", "--seq", "16", "--batch", "4", "--steps", "4",
                "--metrics-out", str(tmp_path / "m.jsonl")], capsys)
    assert [r["epoch"] for r in _records(tmp_path / "m.jsonl")] == pytest.approx([1 / 3, 2 / 3, 1, 4 / 3])
    assert "epoch 0.67" in out and "random tokens" not in out


# ---- a write the OS refuses -------------------------------------------------------------------------

class _Refusing:
    """A file that takes ``room`` bytes, then fails as a full disk does (``room`` None: refused at once)."""

    def __init__(self, path, room, error):
        if room is None:
            raise OSError(error, os.strerror(error), str(path))
        self.f, self.room, self.error = open(path, "wb"), room, error

    def write(self, b):
        if self.f.tell() + len(b) > self.room:
            raise OSError(self.error, os.strerror(self.error))
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _refusing_open(step: int, room, error):
    """``open`` for fxpar.checkpoint (its writer's files): the files of checkpoint ``step`` refuse."""
    def fake(path, mode="r", *args, **kwargs):
        if f"step_{step:08d}" in str(path) and "w" in mode:
            return _Refusing(path, room, error)
        return open(path, mode, *args, **kwargs)
    return fake


@pytest.mark.parametrize("room, error", [(100, errno.ENOSPC), (None, errno.EACCES)], ids=["no-space", "permission"])
def test_refused_checkpoint_write_names_file_and_reason(tmp_path, monkeypatch, capsys, room, error):
    """The disk fills (torch.save's "unexpected pos" hides the OSError) or the file is refused during the
    save of step 3: one line naming the file and the OS's words; 'latest' still names step 2, and the
    partial save is gone."""
    from fxpar import checkpoint
    from fxpar.cli import train

    monkeypatch.setattr(checkpoint, "open", _refusing_open(3, room, error), raising=False)  # the module's open
    ckpt = tmp_path / "ckpt"
    assert train.main(TINY + ["--data", "synthetic", "--steps", "4", "--save", str(ckpt), "--save-every", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxpar: ") and err.count("\n") == 1, err
    partial = ckpt / "step_00000003.partial"
    assert f"checkpoint {ckpt / 'step_00000003'} was not written: {os.strerror(error)} (rank 0 writing {partial}/" \
        in err, err
    assert f"{ckpt / 'latest'} still names the complete step_00000002" in err and "unexpected pos" not in err
    assert (ckpt / "latest").read_text() == "step_00000002\n" and _steps(ckpt) == ["step_00000001", "step_00000002"]


def _save_with_rank1_disk_full(directory: str) -> str:
    import torch
    import torch.distributed as dist

    import fxpar
    from fxpar import checkpoint, zoo
    from fxpar.ir.errors import CheckpointError

    batch = zoo.example_inputs("llama", zoo.tiny_config("llama"), batch=2, seq=8)
    compiled = fxpar.compile(zoo.build("llama", seed=0), "dp=2", example_kwargs=batch, timeout=60,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    checkpoint.save(compiled, directory, 1)
    if dist.get_rank() == 1:
        checkpoint.open = _refusing_open(2, 64, errno.ENOSPC)  # the module's open (the builtin's name)
    try:
        checkpoint.save(compiled, directory, 2)
    except CheckpointError as e:
        return str(e)
    finally:
        vars(checkpoint).pop("open", None)
    return "saved"


@pytest.mark.slow
def test_refused_write_on_one_rank_is_the_same_error_on_both(pool2, tmp_path):
    directory = tmp_path / "ckpt"
    errors = pool2.run(_save_with_rank1_disk_full, str(directory), timeout=120)
    assert errors[0] == errors[1], errors
    assert "No space left on device (rank 1 writing" in errors[0]
    assert "still names the complete step_00000001" in errors[0]
    assert (directory / "latest").read_text() == "step_00000001\n" and _steps(directory) == ["step_00000001"]
