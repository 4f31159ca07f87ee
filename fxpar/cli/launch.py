"""``fxpar launch``: torchrun, with a failed fxpar command reported in its own words.

``fxpar launch [torchrun options] COMMAND [args]`` is ``torchrun [torchrun options] -m fxpar COMMAND [args]``
(the same options, rendezvous, restarts and environment; torch.distributed.run does the work). A script or
``-m module`` after the options runs as under torchrun.

The difference is what a failure prints. torchrun prints a report of about 40 lines whenever a worker exits
non-zero (its own traceback, then each failed rank's time, host, pid and error file), whatever the cause;
there is no exit status it reports more briefly. Under ``fxpar launch`` the workers print nothing of their
failures and write them to torchrun's per-rank error files (:mod:`fxpar.cli.failures`); when every failed
rank wrote one, the launcher prints the lowest failed rank's (a user error: ``fxpar: <message>``; a bug: its
traceback, the rank named) and exits with the status that rank chose (2 for a user error, 1 for a bug; the
agent may have stopped a rank by a signal while it exited). A failure
fxpar did not record (a rank killed by a signal other than the agent's SIGTERM to the ranks left when one
failed, a script's own exception) and any failure with ``FXPAR_TRACEBACK=1`` gets torchrun's report, unchanged.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from fxpar.cli.failures import LAUNCHER_ENV, want_traceback

USAGE = ("usage: fxpar launch [torchrun options] COMMAND [args]\n"
         "  e.g. fxpar launch --standalone --nproc_per_node 2 train llama --plan tp=2 --data synthetic --steps 3\n"
         "  runs torchrun [torchrun options] -m fxpar COMMAND [args] and prints one line for an fxpar error\n"
         "  (`torchrun --help` lists the options)")
# what the elastic agent logs about a failure it then raises as ChildFailedError (held back: the launcher says
# it in one line, or torchrun's report does)
_HELD = ("failed (exitcode", "Sending process")


def torchrun_argv(argv: list[str], commands) -> list[str]:
    """torchrun's command line for ``fxpar launch ARGV``: ``-m fxpar`` put before the first argument that is
    neither an option nor an option's value when it names an fxpar command (one of ``commands``)."""
    from torch.distributed import run

    options = run.get_args_parser()._option_string_actions
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--" or not a.startswith("-"):
            break
        action = options.get(a)
        i += 2 if action is not None and action.nargs != 0 and "=" not in a else 1
    if i < len(argv) and argv[i] in commands:
        return argv[:i] + ["-m", "fxpar"] + argv[i:]
    return argv


class _Hold(logging.Filter):
    """Keeps the agent's failure lines back until the launcher knows whether it reports the failure itself."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(_HELD):
            self.records.append(record)
            return False
        return True


def summary(failures: dict) -> tuple[int, str] | None:
    """``(exit status, text)`` for torchrun's failures (global rank -> ``ProcessFailure``) when the failed ranks
    recorded their failures the fxpar way, else None. The text is the lowest such rank's. A rank that recorded
    nothing and ended by SIGTERM was stopped by the agent (it stops the others once one fails, some maybe
    before they got as far as the error) and is left out; any other unrecorded failure gets torchrun's report."""
    recorded, stopped = {}, []
    for r, f in failures.items():
        entry = f.error_file_data.get("fxpar") if isinstance(f.error_file_data, dict) else None
        if isinstance(entry, dict) and "message" in entry:
            recorded[r] = entry
        elif f.exitcode == -signal.SIGTERM:
            stopped.append(r)
        else:
            return None
    if not recorded:
        return None
    first = min(recorded)
    text = recorded[first]["message"].rstrip()
    others = sorted(r for r in recorded if r != first)
    if recorded[first].get("kind") == "bug" and others:
        text += (f"\nfxpar: rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too "
                 "(FXPAR_TRACEBACK=1 prints each one's traceback)")
    return int(recorded[first].get("code", 1)), text


def main(argv: list[str], commands=()) -> int:
    """Run ``fxpar launch ARGV``. Returns the exit status; a failure fxpar did not record raises torchrun's
    ``ChildFailedError`` (whose report Python prints, as torchrun's)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    args = run.parse_args(torchrun_argv(argv, commands))
    os.environ[LAUNCHER_ENV] = "1"  # the workers inherit it: they record their failures and print none
    hold = _Hold()
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(hold)
    try:
        # like torchrun's own main, hand the root cause to a scheduler that gave the launcher an error file
        (record(run.run) if os.environ.get("TORCHELASTIC_ERROR_FILE") else run.run)(args)
    except ChildFailedError as e:
        found = None if want_traceback() else summary(e.failures)
        agent_log.removeFilter(hold)
        if found is None:
            for r in hold.records:
                agent_log.handle(r)
            raise
        print(found[1], file=sys.stderr)
        return found[0]
    finally:
        agent_log.removeFilter(hold)
    return 0
