"""One round of answers from the ranks of a :class:`fxpar.testing.multiproc.RankPool`.

:func:`collect` waits (with a deadline) for one answer from each rank, and
:func:`failure_message` describes a round that did not complete: which ranks raised,
died or did not answer, their tracebacks and the tail of their output.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

OUTPUT_TAIL_CHARS = 4000


@dataclasses.dataclass
class Replies:
    """One round of answers: values, (summary, traceback) of raising ranks, exit codes
    of dead ranks, and the ranks that did not answer in time."""

    ok: dict[int, Any]
    errors: dict[int, tuple[str, str]]
    exit_codes: dict[int, int | None]
    pending: set[int]

    @property
    def complete(self) -> bool:
        return not (self.errors or self.exit_codes or self.pending)


def collect(workers: Sequence, world_size: int, timeout: float, failure_grace: float) -> Replies:
    """Wait for one answer from each rank (``workers``: :class:`._rankworker.RankProcess`
    in rank order). After the first failure the other ranks only get ``failure_grace``
    more seconds."""
    replies = Replies({}, {}, {}, set(range(world_size)))
    deadline = time.monotonic() + timeout
    while replies.pending and (remaining := deadline - time.monotonic()) > 0:
        by_conn = {workers[r].conn: r for r in replies.pending}
        for conn in wait(list(by_conn), remaining):
            r = by_conn[conn]
            replies.pending.discard(r)
            kind, *payload = workers[r].receive()
            if kind == "ok":
                replies.ok[r] = payload[0]
            elif kind == "died":
                replies.exit_codes[r] = payload[0]
            else:
                replies.errors[r] = tuple(payload)
        if replies.errors or replies.exit_codes:
            deadline = min(deadline, time.monotonic() + failure_grace)
    return replies


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def fmt_ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def fn_name(fn) -> str:
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def failure_message(
    what: str, timeout: float, replies: Replies, outputs: dict[int, str], world_size: int, failure_grace: float
) -> str:
    """The text of the :class:`RankFailure` (or :class:`RankTimeout`) for an incomplete round."""
    errors, exit_codes, pending = replies.errors, replies.exit_codes, replies.pending
    failed = sorted(errors.keys() | exit_codes.keys())
    n = world_size
    if failed:
        first = min(exit_codes) if exit_codes else failed[0]  # a dead rank is the likely cause
        what_first = errors[first][0] if first in errors else "died, " + describe_exit(exit_codes[first])
        lines = [f"{fmt_ranks(failed)} of {n} failed {what}; rank {first}: {what_first}"]
    else:
        lines = [f"timed out after {timeout:g} s {what}: {fmt_ranks(pending)} of {n} had not answered"]
    lines += [f"  rank {r}: raised {errors[r][0]}" for r in sorted(errors)]
    lines += [f"  rank {r}: died, {describe_exit(exit_codes[r])}" for r in sorted(exit_codes)]
    if pending:
        limit = f"{failure_grace:g} s after the failure" if failed else f"{timeout:g} s"
        lines.append(f"  {fmt_ranks(pending)}: no answer within {limit}; killed")
    if replies.ok:
        lines.append(f"  {fmt_ranks(replies.ok)}: answered")
    lines.append("The pool was torn down; the next run() restarts it.")
    lines += [f"\n---- rank {r} traceback ----\n{errors[r][1].rstrip()}" for r in sorted(errors)]
    for r in sorted(errors.keys() | exit_codes.keys() | pending):
        if outputs[r].strip():
            label = "output and stacks" if r in pending else "output"
            lines.append(f"\n---- rank {r} {label} (tail) ----\n{outputs[r][-OUTPUT_TAIL_CHARS:].rstrip()}")
    return "\n".join(lines)
