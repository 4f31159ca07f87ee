"""Where a fine-tuning run saves and what it resumes from, as HF Trainer users expect it.

* ``--save DIR`` writes a checkpoint at the last step; ``--save-every K`` also every K steps (the last
  step always, once). ``--save-total-limit N`` keeps the N newest ``step_<N>`` directories (Trainer's
  ``save_total_limit``), never the one ``latest`` names; rank 0 removes the others once a save has
  finished on every rank.
* ``--resume PATH``: a ``step_<N>`` directory resumes from exactly that checkpoint, the directory
  ``--save`` wrote into from its latest (its ``latest`` file, else its highest complete step). A path that
  does not exist or holds no checkpoint is an error. ``--resume auto`` resumes from ``--save DIR``'s latest
  when there is one and starts at step 0 otherwise (a job that torchrun restarts: ``--save DIR
  --resume auto``); it is the only form that may find nothing, and it says which way it went.

Everything here is checked before any rank communicates: the options, the checkpoint to resume from,
then that every output directory can be written (each rank creates it and writes and removes a file).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from fxpar import checkpoint
from fxpar.ir.errors import CheckpointError, PlanError


def check_options(args) -> None:
    """The save options on their own and together."""
    a = args
    every, limit = getattr(a, "save_every", 0) or 0, getattr(a, "save_total_limit", None)
    if every < 0:
        raise PlanError(f"--save-every {every}: give a positive number of steps (0 or none: save at the end only)")
    if every and not a.save:
        raise PlanError(f"--save-every {every} without --save: give --save DIR, the directory to write checkpoints to")
    if limit is not None and limit < 1:
        raise PlanError(f"--save-total-limit {limit}: keep at least 1 checkpoint (none given: keep every one)")
    if limit is not None and not a.save:
        raise PlanError(f"--save-total-limit {limit} without --save: give --save DIR, the directory it prunes")


def check_outputs(args) -> None:
    """Every directory the run writes to, created and written once (a probe file), on every rank."""
    a = args
    files = {"--metrics-out": getattr(a, "metrics_out", None), "--losses-out": getattr(a, "losses_out", None)}
    outputs = {"--save": a.save, "--export": getattr(a, "export", None),
               "--tensorboard": getattr(a, "tensorboard", None),
               **{flag: str(Path(path).parent) for flag, path in files.items() if path}}
    for flag, directory in outputs.items():
        if directory:
            check_writable(directory, flag)


def check_writable(directory: str | Path, what: str) -> Path:
    """Create ``directory`` (and its parents), write and remove a probe file in it; a place this rank cannot
    write is a :class:`CheckpointError` naming ``what``, the directory and the OS's reason."""
    directory = Path(directory)
    probe = directory / f".fxpar-write-test.{socket.gethostname()}.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"fxpar")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or str(e)
        raise CheckpointError(f"{what} {directory}: cannot write there: {reason} ({e.filename or directory}); "
                              f"give {what} a directory this user may write to", path=directory,
                              reason=reason) from None
    return directory


def find(path: str | Path) -> Path:
    """The checkpoint ``path`` names: a ``step_<N>`` directory (``fxpar.json`` in it), or the directory
    ``checkpoint.save`` wrote into (the checkpoint its ``latest`` names, else its highest complete step).
    :class:`CheckpointError` saying what was expected when ``path`` does not exist or holds none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory", path=path, reason="missing")
    if (path / "fxpar.json").is_file():
        return path
    found = checkpoint.latest(path) or (checkpoint.checkpoints(path) or [None])[-1]
    if found is not None:
        return found
    unfinished = sorted(p.name for p in path.glob("step_*.partial")) if path.is_dir() else []
    raise CheckpointError(
        f"{path} holds no complete fxpar checkpoint: expected a step_<N> directory with fxpar.json or a "
        "directory of them with a 'latest' file (what --save writes)"
        + (f"; {', '.join(unfinished)} never finished" if unfinished else ""), path=path, reason="no checkpoint")


def resume_point(args) -> tuple[Path | None, str | None]:
    """``(checkpoint, None)`` to resume from, or ``(None, why not)`` for ``--resume auto`` with nothing
    saved yet, or ``(None, None)`` without ``--resume``. Bad paths are errors naming the fix."""
    a = args
    if not a.resume:
        return None, None
    if a.resume == "auto":
        if not a.save:
            raise PlanError("--resume auto resumes from --save DIR's latest checkpoint: give --save DIR too, "
                            "or --resume PATH (a step_<N> checkpoint or the directory --save wrote into)")
        if not checkpoint.checkpoints(a.save) and checkpoint.latest(a.save) is None:
            return None, f"--resume auto: no checkpoint in {a.save} yet: starting at step 0"
        return find(a.save), None
    try:
        return find(a.resume), None
    except CheckpointError as e:
        fix = (" (--resume auto: --save's latest checkpoint when there is one, else a fresh start)"
               if a.save and Path(a.save) == Path(a.resume) else "")
        raise CheckpointError(f"--resume {e}; give a step_<N> checkpoint or the directory --save wrote into{fix}",
                              path=e.path, reason=e.reason) from None


class Saver:
    """When the loop saves (:func:`due`) and the save itself with its pruning (:meth:`save`)."""

    def __init__(self, args, rank: int):
        self.dir, self.every, self.steps = args.save, args.save_every or 0, args.steps
        self.limit, self.rank = getattr(args, "save_total_limit", None), rank

    def due(self, step: int) -> bool:
        """Whether the checkpoint after ``step`` steps is written: every ``--save-every`` and at the end."""
        return bool(self.dir) and (step == self.steps or bool(self.every) and step % self.every == 0)

    def save(self, compiled, step: int, extra: dict) -> tuple[Path, list[Path]]:
        """Every rank: save the checkpoint of ``step``; then rank 0 prunes to ``--save-total-limit``.
        Returns the checkpoint and what was removed (rank 0)."""
        from fxpar.runtime.liveness import guard

        with guard("saving a checkpoint"):  # a peer lost during the save is named
            path = checkpoint.save(compiled, self.dir, step, extra=extra)
        # save returns once every rank has written (its last barrier): rank 0 alone prunes
        return path, prune(self.dir, self.limit) if self.rank == 0 and self.limit else []


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest complete checkpoints under ``directory`` (by step, as Trainer's
    ``save_total_limit``), never the one ``latest`` names. Returns what it removed; what it cannot remove
    is said on stdout (the run goes on: its checkpoints are intact)."""
    kept, removed = checkpoint.latest(directory), []
    for p in [p for p in checkpoint.checkpoints(directory)[:-keep] if p != kept]:
        try:
            shutil.rmtree(p)
            removed.append(p)
        except OSError as e:
            print(f"fxpar train: --save-total-limit {keep}: could not remove {p}: {e.strerror or e} "
                  f"({e.filename or p})", flush=True)
    return removed
