"""The ``fxpar`` command run in a process that is already a rank of a process group (a
:mod:`fxpar.testing.multiproc` pool): what ``torchrun ... -m fxpar ARGS`` runs on each rank, without a
launcher and a fresh interpreter per rank (4-9 s of imports each on the 2-core CI host). A test keeps one
real ``torchrun`` run for the launch itself and runs its other invocations this way.

Reads: the argument list. Writes: what the command writes (checkpoints, exports, loss files).
"""

from __future__ import annotations

import contextlib
import io

__all__ = ["fxpar_on_rank"]


def fxpar_on_rank(argv: list[str]) -> tuple[int, str, str]:
    """``fxpar ARGV`` on this rank: (exit status, stdout, stderr). The process group must exist
    (``fxpar.launch.init_distributed`` joins it as it is)."""
    from fxpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()
