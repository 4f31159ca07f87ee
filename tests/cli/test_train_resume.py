"""``torchrun --max-restarts 1 -m fxpar train ... --save D --resume auto`` survives a rank killed after a
checkpoint: torchrun starts the group again, the run resumes from ``D/latest`` (the first attempt, with no
checkpoint yet, starts at step 0) and its per-step losses equal those of a run that never stopped.

The killing is done by this file run as a script: it wraps ``fxpar.checkpoint.save`` so that rank 1 of the
first attempt (``TORCHELASTIC_RESTART_COUNT=0``) SIGKILLs itself right after the save of step ``KILL_AFTER``,
then runs ``fxpar train`` with the given arguments.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar.testing import multiproc
from fxpar.testing.cli import fxpar_on_rank

pool2 = multiproc.rank_pool(2)
HERE = os.path.abspath(__file__)
STEPS, SAVE_EVERY, KILL_AFTER = 6, 2, 4


def _killing_train(argv: list[str]) -> int:
    from fxpar import checkpoint
    from fxpar.cli import train

    save = checkpoint.save

    def save_then_die(compiled, directory, step, **kw):
        path = save(compiled, directory, step, **kw)
        if step == KILL_AFTER and compiled.rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            # a file, not stdout: the ranks share torchrun's stdout and their lines can interleave
            (Path(directory).parent / "killed").write_text(f"rank 1: SIGKILL after saving step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    checkpoint.save = save_then_die
    return train.main(argv)


_ARGS = ["llama", "--data", "synthetic", "--plan", "pp=2,microbatches=2", "--batch", "4", "--seq", "16",
         "--steps", str(STEPS)]


def _torchrun_restarting(tmp_path, ckpt: str) -> subprocess.CompletedProcess:
    """The run a rank kills itself in, under torchrun with one restart, resuming from its latest save."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", HERE, *_ARGS, "--losses-out", str(tmp_path / "restarted.losses"),
           "--save", ckpt, "--save-every", str(SAVE_EVERY), "--resume", "auto"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPAR_TIMEOUT": "30"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)


def _printed(stdout: str) -> dict[int, float]:
    """step -> loss as rank 0 printed it (4 decimals); a resumed attempt overwrites the steps it redoes."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"step (\d+)/\d+  loss ([0-9.]+)", stdout)}


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_torchrun_restart_resumes_from_latest_with_the_same_losses(tmp_path, pool2):
    ckpt = str(tmp_path / "ckpt")
    restarted = _torchrun_restarting(tmp_path, ckpt)
    out = restarted.stdout + restarted.stderr
    assert restarted.returncode == 0, out[-4000:]
    assert (tmp_path / "killed").read_text() == f"rank 1: SIGKILL after saving step {KILL_AFTER}"
    assert f"--resume auto: no checkpoint in {ckpt} yet: starting at step 0" in restarted.stdout, out[-4000:]
    assert f"resuming from {ckpt}/step_{KILL_AFTER:08d} (step {KILL_AFTER})" in restarted.stdout, out[-4000:]
    # the uninterrupted run: the same command on a pool's 2 ranks (no launcher needed to compare against)
    (rc, whole, err), _ = pool2.run(fxpar_on_rank, ["train", *_ARGS, "--losses-out", str(tmp_path / "whole.losses")])
    assert rc == 0, err[-4000:]

    resumed = [float(x) for x in (tmp_path / "restarted.losses").read_text().split()]  # steps after the restart
    straight = [float(x) for x in (tmp_path / "whole.losses").read_text().split()]
    curve, reference = _printed(restarted.stdout), _printed(whole)
    print("uninterrupted:", straight, "\nresumed steps", KILL_AFTER + 1, "..:", resumed)
    assert len(straight) == STEPS and len(resumed) == STEPS - KILL_AFTER
    assert max(abs(a - b) for a, b in zip(resumed, straight[KILL_AFTER:])) <= 1e-6
    assert sorted(curve) == list(range(1, STEPS + 1)) and curve == reference  # the whole printed curve


if __name__ == "__main__":
    sys.exit(_killing_train(sys.argv[1:]))
