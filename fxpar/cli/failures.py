"""How a failed ``fxpar`` command ends: on one process, and on each rank of a launched job.

One process: a user error (an :class:`fxpar.ir.errors.FxparError`, or a command line argparse refuses) prints
``fxpar: <message>`` and exits 2; anything else is a bug and Python prints its traceback (exit 1).

Under a launcher (``WORLD_SIZE`` > 1 in the environment; every rank knows its ``RANK`` from it before any
process group exists) each failing rank

- writes its failure to torchrun's per-rank error file (``TORCHELASTIC_ERROR_FILE``) when there is one, in
  the JSON form of ``torch.distributed.elastic``'s ``ErrorHandler`` with an ``"fxpar"`` entry added: a
  user error as its message, a bug as its traceback;
- prints it on stderr only where no one else will: on rank 0 under plain ``torchrun`` (whose failure
  report shows every failing rank's error file), never under ``fxpar launch`` (the launcher prints the
  lowest failed rank's, :mod:`fxpar.cli.launch`), and on every failing rank where there is no error file;
- exits 2 for a user error, 1 for a bug.

``FXPAR_TRACEBACK=1`` keeps the full traceback: user errors carry theirs (printed and in the error file),
and ``fxpar launch`` shows torchrun's own report with every failed rank's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback

from fxpar.ir.errors import OptionError
from fxpar.ir.options import RunOptions, run_options

USER_ERROR = 2  # the exit status of a user error, on one process and on every rank
BUG = 1  # what Python itself exits with on an uncaught exception
LAUNCHER_ENV = "FXPAR_LAUNCHER"  # set by `fxpar launch` for its workers: the launcher prints failures


def rank() -> int:
    """This process's global rank as the launcher's environment gives it (0 without a launcher)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0)


def multi_rank() -> bool:
    """True when a launcher started this process as one of several ranks."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def want_traceback() -> bool:
    return _options().traceback  # FXPAR_TRACEBACK


def _error_file() -> str | None:
    return os.environ.get("TORCHELASTIC_ERROR_FILE") or None


def _prints(has_file: bool) -> bool:
    """Whether this rank prints its own failure (see the module docstring)."""
    if not multi_rank() or not has_file:
        return True
    return not _options().launcher and rank() == 0


def _options() -> RunOptions:
    """The run options, or their defaults where a variable holds a bad value: reporting a failure (that
    one's OptionError too) must not fail itself."""
    try:
        return run_options()
    except OptionError:
        return RunOptions()


def _record(kind: str, message: str, text: str, code: int) -> bool:
    """Write the failure into torchrun's error file for this rank: ``message`` is what ``fxpar launch`` prints,
    ``text`` what torchrun's own report shows, ``code`` the exit status this rank ends with (the launcher
    exits with it even where the agent stopped the rank by a signal while it exited). Returns whether there
    was a file to write."""
    path = _error_file()
    if path is None:
        return False
    data = {"message": {"message": message, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}},
            "fxpar": {"kind": kind, "rank": rank(), "message": message, "code": code}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def user_error(message: str, exc: BaseException | None = None, code: int = USER_ERROR) -> int:
    """End a command on a user error: ``message`` (``fxpar: ...``) printed or recorded as above. Returns
    the exit status."""
    if exc is not None and want_traceback():
        message = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + message
    has_file = multi_rank() and _record("user", message, message, code)
    if _prints(has_file):
        print(message, file=sys.stderr)
    return code


def bug(exc: BaseException) -> int:
    """End a command on an unexpected exception under a launcher: the traceback with the rank named, printed
    or recorded as above. Returns the exit status (1, as Python's own)."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = f"fxpar: rank {rank()} failed with an unexpected error (a bug in fxpar or the model):\n{trace}"
    has_file = _record("bug", message, trace, BUG)
    if _prints(has_file):
        print(message, file=sys.stderr, end="")
    return BUG


def parse_args(parser, argv):
    """``parser.parse_args(argv)``, whose refusal under a launcher is a user error like any other (one copy
    of argparse's usage and message, not one per rank); ``--help`` prints on rank 0 only. Raises
    ``SystemExit`` as argparse does."""
    if not multi_rank():
        return parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return parser.parse_args(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else USER_ERROR
        if code == 0:
            if rank() == 0:
                sys.stdout.write(out.getvalue())
            raise
        raise SystemExit(user_error(err.getvalue().rstrip(), code=code)) from None
