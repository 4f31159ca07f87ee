"""What a failed ``fxpar`` command shows on a launched job (``fxpar.cli.failures``, ``fxpar.cli.launch``):
a user error is one message from one rank, exit status 2; a bug keeps its traceback, from one rank, named;
rank 0 alone speaks at INFO. The ranks are simulated in-process by the environment torchrun gives them
(``WORLD_SIZE``, ``RANK``, ``TORCHELASTIC_ERROR_FILE``); one case runs ``fxpar launch`` itself."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from fxpar.cli import failures, main
from fxpar.cli.launch import summary, torchrun_argv

BAD_PLAN = ["train", "llama", "--data", "synthetic", "--steps", "1", "--plan", "tp=2,bogus=1"]
MESSAGE = "unknown key 'bogus'"


@pytest.fixture
def as_rank(monkeypatch, tmp_path):
    """as_rank(r, launcher=False, error_file=True): this process is rank r of 2 under torchrun (or under
    ``fxpar launch``); returns the path of its torchrun error file (None: torchrun gave it none)."""
    for var in ("FXPAR_TRACEBACK", failures.LAUNCHER_ENV, "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(var, raising=False)

    def make(rank: int, launcher: bool = False, error_file: bool = True):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        if launcher:
            monkeypatch.setenv(failures.LAUNCHER_ENV, "1")
        if not error_file:
            return None
        path = tmp_path / f"error_{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        return path

    return make


def _recorded(path) -> dict:
    return json.loads(path.read_text())["fxpar"]


def test_user_error_printed_by_rank_0_only_and_recorded_by_each_rank(as_rank, no_communication, capsys):
    """Plain torchrun: rank 0 prints the one line, rank 1 prints nothing; both record it for torchrun's
    report and exit 2. (Before: every rank printed it.)"""
    for rank in (1, 0):
        path = as_rank(rank)
        assert main(BAD_PLAN) == 2
        err = capsys.readouterr().err
        assert err.count(MESSAGE) == (1 if rank == 0 else 0), (rank, err)
        entry = _recorded(path)
        assert entry["kind"] == "user" and entry["code"] == 2 and entry["message"].startswith("fxpar: ")
        assert MESSAGE in entry["message"] and "Traceback" not in entry["message"]


def test_compile_refuses_a_plan_the_world_cannot_hold_before_joining(as_rank, no_communication):
    """``fxpar.compile`` under torchrun, no group yet: tp=3 on 2 ranks is refused from WORLD_SIZE before it
    joins the group (before: it joined first, and a rank still connecting printed gloo's "Connection closed by
    peer" beside the message)."""
    import torch

    import fxpar
    from fxpar import zoo
    from fxpar.ir.errors import PlanError

    as_rank(0)
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(PlanError, match="needs 3 ranks, but the world has 2"):
        fxpar.compile(zoo.build("llama"), "tp=3", example_kwargs={"input_ids": ids, "labels": ids})


def test_under_fxpar_launch_no_rank_prints(as_rank, no_communication, capsys):
    path = as_rank(0, launcher=True)
    assert main(BAD_PLAN) == 2
    assert capsys.readouterr().err == ""
    assert MESSAGE in _recorded(path)["message"]


def test_without_an_error_file_every_rank_prints(as_rank, no_communication, capsys):
    as_rank(1, error_file=False)  # a launcher that collects no error files: printing is the only way out
    assert main(BAD_PLAN) == 2
    assert capsys.readouterr().err.count(MESSAGE) == 1


def test_fxpar_traceback_keeps_the_trace_of_a_user_error(as_rank, no_communication, monkeypatch, capsys):
    path = as_rank(1)
    monkeypatch.setenv("FXPAR_TRACEBACK", "1")
    assert main(BAD_PLAN) == 2
    message = _recorded(path)["message"]
    assert message.startswith("Traceback") and "PlanError" in message and MESSAGE in message


def test_argparse_refusal_is_one_user_error(as_rank, capsys):
    path = as_rank(1)
    with pytest.raises(SystemExit) as e:
        main(["train", "llama", "--steps", "many"])
    assert e.value.code == 2 and capsys.readouterr().err == ""
    assert "invalid int value: 'many'" in _recorded(path)["message"]


def _boom(args):
    raise RuntimeError("boom in the model")


def test_a_bug_keeps_its_traceback_with_the_rank_named(as_rank, monkeypatch, capsys):
    monkeypatch.setattr("fxpar.cli.cmd_zoo", _boom)
    with pytest.raises(RuntimeError, match="boom"):  # one process: Python's own traceback
        main(["zoo"])
    path = as_rank(0)
    assert main(["zoo"]) == 1
    err = capsys.readouterr().err
    assert "rank 0 failed with an unexpected error" in err and "Traceback (most recent call last)" in err
    assert err.count("RuntimeError: boom in the model") == 1
    entry = _recorded(path)
    assert entry["kind"] == "bug" and entry["code"] == 1 and "Traceback" in entry["message"]
    # torchrun's own report shows the traceback from the error file
    assert "RuntimeError: boom" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]


def _news(args):
    logging.getLogger("fxpar.runtime.programs").info("fxpar: compiling program 1")
    logging.getLogger("fxpar").warning("fxpar: a warning")
    return 0


@pytest.mark.parametrize("rank,shown", [(0, "fxpar: compiling program 1\nfxpar: a warning\n"),
                                        (1, "rank 1: fxpar: a warning\n")])
def test_rank_0_speaks_for_the_job_at_info(as_rank, monkeypatch, capsys, rank, shown):
    """The "compiling program" line (INFO on the ``fxpar`` logger) comes from rank 0 only; a warning from
    another rank still shows, named. The command leaves the logger as it found it."""
    logger = logging.getLogger("fxpar")
    before = (list(logger.handlers), logger.level)
    monkeypatch.setattr("fxpar.cli.cmd_zoo", _news)
    as_rank(rank)
    assert main(["zoo"]) == 0
    assert capsys.readouterr().err == shown
    assert (logger.handlers, logger.level) == before


def test_launcher_prints_the_lowest_failed_ranks_record(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank, exitcode, record):
        path = tmp_path / f"{rank}_{exitcode}_{record and record['kind']}.json"
        if record is not None:
            path.write_text(json.dumps({"message": {"message": record["message"], "extraInfo": {"timestamp": "0"}},
                                        "fxpar": record}))
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    user = {"kind": "user", "message": "fxpar: plan 'x': bad", "code": 2}
    bug = {"kind": "bug", "message": "fxpar: rank 0 failed with an unexpected error ...", "code": 1}
    # rank 0 recorded its user error and was stopped by the agent while it exited (-15): still status 2
    assert summary({3: failure(3, 2, user), 0: failure(0, -15, user)}) == (2, "fxpar: plan 'x': bad")
    code, text = summary({0: failure(0, 1, bug), 1: failure(1, 1, bug), 2: failure(2, 1, bug)})
    assert code == 1 and text.startswith(bug["message"]) and "ranks 1, 2 failed too" in text
    # rank 1 failed first; the agent stopped rank 0 (SIGTERM) before rank 0 got as far as the error
    assert summary({1: failure(1, 2, user), 0: failure(0, -15, None)}) == (2, "fxpar: plan 'x': bad")
    assert summary({0: failure(0, 2, user), 1: failure(1, -9, None)}) is None  # a kill: torchrun's report
    assert summary({0: failure(0, 1, None)}) is None  # not fxpar's (a script's own exception)


def test_launch_puts_the_command_after_torchruns_options():
    cmds = ("train", "generate")
    assert torchrun_argv(["--standalone", "--nproc_per_node", "2", "train", "llama"], cmds) == \
        ["--standalone", "--nproc_per_node", "2", "-m", "fxpar", "train", "llama"]
    assert torchrun_argv(["--nproc-per-node=2", "--rdzv-id", "train", "generate", "d"], cmds) == \
        ["--nproc-per-node=2", "--rdzv-id", "train", "-m", "fxpar", "generate", "d"]
    script = ["--nproc_per_node", "2", "examples/finetune_hf.py", "train"]
    assert torchrun_argv(script, cmds) == script


@pytest.mark.slow
def test_fxpar_launch_user_error_is_a_few_lines(tmp_path):
    """Two real ranks under ``fxpar launch``: the terminal (stdout and stderr together) shows the message
    once, in at most 10 lines, and the job exits 2 (torchrun alone prints ~45 lines: docs/launch.md)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FXPAR_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "fxpar", "launch", "--standalone", "--nproc_per_node", "2", *BAD_PLAN],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=env, cwd=tmp_path)
    lines = r.stdout.splitlines()
    assert r.returncode == 2, r.stdout
    assert len(lines) <= 10 and r.stdout.count(MESSAGE) == 1, r.stdout
    assert lines[0].startswith("fxpar: plan 'tp=2,bogus=1'"), r.stdout
