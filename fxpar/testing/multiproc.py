"""Multi-rank test harness: a pool of real gloo ranks, started once and reused.

Design, in short:

* ``RankPool(n)`` starts ``n`` worker processes; each joins a gloo process group
  (rendezvous through a ``TCPStore`` hosted by the pool's owner) and then serves
  ``pool.run(fn, *args, **kwargs)`` calls. Workers are forked from the stdlib
  *forkserver*, which imports torch, transformers, pytest and the modules given to
  :func:`set_preload` once per process, so a pool starts in a fraction of a second.
  Workers mirror the owner's ``os.environ`` with ``OMP_NUM_THREADS=1`` and use one
  torch thread. A *script* (not pytest) that makes a pool needs an
  ``if __name__ == "__main__":`` guard.
* ``fn`` and its arguments are pickled by reference, with the file of each module
  they come from (see :mod:`fxpar.testing._rankworker`), so rank functions may live
  in the test module itself, even under ``pytest --import-mode=importlib``. They
  must be module-level, and the test module must have no side effects at import.
  ``fn`` may also be a ``"package.module:qualname"`` string.
* If a rank raises, dies or does not answer within ``timeout``, ``run`` raises
  :class:`RankFailure` (:class:`RankTimeout`) naming the ranks, with tracebacks, exit
  codes and the tail of their output. The other ranks get ``failure_grace`` seconds
  to answer, then have their Python stacks dumped (faulthandler, ``SIGUSR1``) and are
  killed; the next ``run`` starts a fresh pool. ``close()`` instead closes the workers'
  pipes and lets them exit normally (their finalizers release what they hold), killing
  only those still there after ``close_grace`` seconds. Nothing waits without a deadline,
  and the workers die with the owner (daemonic, and ``PR_SET_PDEATHSIG``), so a
  killed test run leaves no ranks behind.
* Each rank's stdout/stderr go to a log file; after each run the new output is
  echoed to the owner's stdout prefixed with ``[rank r]``.

Usage in a test module::

    from fxpar.testing import multiproc

    pool4 = multiproc.rank_pool_fixture(4)        # module-scoped pytest fixture

    def _allreduce(n):                            # module level: shipped by reference
        import torch, torch.distributed as dist
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        return t

    def test_sum(pool4):
        outs = pool4.run(_allreduce, 3, timeout=30)   # one value per rank, rank order
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from fxpar.testing import _rankreplies, _rankworker

__all__ = [
    "RankFailure",
    "RankTimeout",
    "RankPool",
    "run_on_ranks",
    "rank_pool_fixture",
    "rank_pool",
    "shared_rank_pool",
    "set_preload",
    "rank_info",
]

# Modules the forkserver imports once, before forking workers (see set_preload).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "fxpar.testing.multiproc"]
if importlib.util.find_spec("transformers") is not None:
    # with what a first compile of a zoo model imports (the model classes' modeling_utils, generation and
    # accelerate, export's passes, AOT autograd, Inductor's code generation): about 0.5 s of one core per rank
    # per pool otherwise, paid again by every pool a test module starts
    _PRELOAD += ["transformers", "fxpar.zoo", "transformers.models.llama.modeling_llama",
                 "transformers.models.gpt2.modeling_gpt2", "torch._export.passes", "torch._functorch.aot_autograd",
                 "torch._inductor.codegen.common"]


def set_preload(modules: Sequence[str]) -> None:
    """Add modules for the forkserver to import once (e.g. a model zoo). Only effective
    before the process's first pool starts the forkserver."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def rank_info() -> dict:
    """Small self-test function: this rank's identity (``"fxpar.testing.multiproc:rank_info"``)."""
    import torch
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "num_threads": torch.get_num_threads(),
    }


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not answer during ``RankPool.run``.

    Attributes: ``failures`` (rank -> traceback text), ``exit_codes`` (rank -> exit
    code of ranks that died by themselves), ``unanswered`` (ranks that never answered
    and were killed), ``results`` (per-rank results, ``None`` where a rank did not return).
    """

    def __init__(
        self,
        message: str,
        failures: dict[int, str] | None = None,
        exit_codes: dict[int, int] | None = None,
        unanswered: Sequence[int] = (),
        results: list[Any] | None = None,
    ):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.exit_codes = dict(exit_codes or {})
        self.unanswered = sorted(unanswered)
        self.results = results

    @property
    def ranks(self) -> list[int]:
        """Ranks that failed by themselves (raised or died)."""
        return sorted(self.failures.keys() | self.exit_codes.keys())


class RankTimeout(RankFailure):
    """No rank failed, but ``unanswered`` ranks had not answered within the timeout."""


class RankPool:
    """``world_size`` gloo ranks in worker processes, reused across many ``run`` calls.

    Args:
        world_size: number of ranks.
        timeout: default seconds for one ``run`` (overridable per call).
        pg_timeout: process-group timeout inside the workers (collectives give up after it).
        start_timeout: seconds for workers to start and initialise the process group.
        failure_grace: after a rank fails, seconds the other ranks get to answer before
            their stacks are dumped and the pool is torn down.
        backend: process-group backend ("gloo").
        start_method: "forkserver" (default where available) or "spawn".
        capture_output: send worker stdout/stderr to per-rank log files (else inherit).
        echo_output: after each run, print the ranks' new output to this process's stdout.
        env: extra environment variables for the workers.

    The pool starts on the first ``run`` or with ``start()`` / ``with``; after a
    :class:`RankFailure` the next ``run`` restarts it (``pool.restarts`` counts this).
    Not thread-safe.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 120.0,
        pg_timeout: float = 120.0,
        start_timeout: float = 120.0,
        failure_grace: float = 2.0,
        backend: str = "gloo",
        start_method: str | None = None,
        capture_output: bool = True,
        echo_output: bool = True,
        env: dict[str, str] | None = None,
    ):
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.failure_grace = failure_grace
        self.backend = backend
        if start_method is None:
            start_method = (
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            )
        self.start_method = start_method
        self.capture_output = capture_output
        self.echo_output = echo_output
        self.env = dict(env or {})
        self._starts = 0
        self._workers: list[_rankworker.RankProcess] = []
        self._store = None  # the rendezvous TCPStore, kept for the life of the workers
        self._closed = False
        self._logdir = tempfile.TemporaryDirectory(prefix=f"fxpar-rankpool{world_size}-")
        self.close_grace = 10.0  # seconds idle workers get to exit on close() before they are killed
        weakref.finalize(self, _stop_workers, self._workers, self.close_grace)

    @property
    def restarts(self) -> int:
        """How many times the pool was started again (after a failure or ``restart()``)."""
        return max(0, self._starts - 1)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> RankPool:
        """Start the workers (if needed) and wait until every rank has joined the group."""
        if self._closed:
            raise RuntimeError("RankPool is closed")
        if not self._workers:
            self._start()
        return self

    def restart(self) -> None:
        self._teardown(self.close_grace)
        self.start()

    def close(self) -> None:
        """Let the workers exit (killing those that do not within ``close_grace``) and remove their logs."""
        self._closed = True
        self._teardown(self.close_grace)
        self._logdir.cleanup()

    def run(self, fn: Callable | str, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises :class:`RankFailure` if any rank raises or dies, :class:`RankTimeout` if
        some rank has not answered after ``timeout`` seconds (default: the pool's); either
        way the next ``run`` restarts the pool. ``timeout`` is never passed on to ``fn``.
        """
        timeout = self.timeout if timeout is None else timeout
        message = _rankworker.pack_call(fn, args, kwargs)  # fails here, pool untouched
        if any(w.broken() for w in self._workers):
            self._teardown()  # a worker died while idle
        self.start()
        for w in self._workers:
            w.send(message)
        replies = self._collect(timeout)
        if not replies.complete:
            raise self._fail(f"running {_rankreplies.fn_name(fn)}", timeout, replies)
        self._echo({w.rank: w.new_output() for w in self._workers})
        return [replies.ok[r] for r in range(self.world_size)]

    def _teardown(self, grace: float = 0.0) -> None:
        _stop_workers(self._workers, grace)
        self._store = None

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":  # test modules loaded by the workers import pytest
            ctx.set_forkserver_preload(_PRELOAD + ["pytest"] * ("pytest" in sys.modules))
        self._starts += 1
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.start_timeout),
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.update(self.env)
        config = dict(
            world_size=self.world_size,
            env=env,
            store_port=self._store.port,
            backend=self.backend,
            start_timeout=self.start_timeout,
            pg_timeout=self.pg_timeout,
            owner_pid=os.getpid(),
        )
        try:
            for rank in range(self.world_size):
                log = os.path.join(self._logdir.name, f"rank{rank}.log") if self.capture_output else None
                self._workers.append(_rankworker.RankProcess.start(ctx, rank, log, **config))
            replies = self._collect(self.start_timeout)
        except BaseException:
            self._teardown()
            raise
        if not replies.complete:
            raise self._fail(f"starting the {self.backend} process group", self.start_timeout, replies)

    def _collect(self, timeout: float) -> _rankreplies.Replies:
        """Wait for one answer from each rank (:func:`._rankreplies.collect`); tears the
        pool down if interrupted (KeyboardInterrupt, pytest-timeout)."""
        try:
            return _rankreplies.collect(self._workers, self.world_size, timeout, self.failure_grace)
        except BaseException:
            self._teardown()
            raise

    def _fail(self, what: str, timeout: float, replies: _rankreplies.Replies) -> RankFailure:
        """Dump the stacks of ranks still running, tear the pool down, and describe it all."""
        if self.capture_output and replies.pending:
            _rankworker.dump_stacks([self._workers[r] for r in replies.pending])
        outputs = {w.rank: w.new_output() for w in self._workers}
        self._teardown()
        self._echo(outputs)

        message = _rankreplies.failure_message(what, timeout, replies, outputs, self.world_size, self.failure_grace)
        return (RankFailure if replies.errors or replies.exit_codes else RankTimeout)(
            message,
            failures={r: tb for r, (_, tb) in replies.errors.items()},
            exit_codes=replies.exit_codes,
            unanswered=replies.pending,
            results=[replies.ok.get(r) for r in range(self.world_size)],
        )

    def _echo(self, outputs: dict[int, str]) -> None:
        if self.echo_output:
            for r in sorted(outputs):
                sys.stdout.write("".join(f"[rank {r}] {line}\n" for line in outputs[r].splitlines()))
            sys.stdout.flush()


def _stop_workers(workers: list[_rankworker.RankProcess], grace: float = 0.0) -> None:
    """Stop the workers. With ``grace`` (an orderly close), first close their pipes: an idle worker
    then returns from its loop and exits normally, which runs its multiprocessing finalizers, and
    those unlink the named semaphores it created (tqdm makes one in every process that runs torch's
    FakeTensorProp); a worker killed instead leaves them to the resource tracker, which warns about
    "leaked semaphore objects" when this process ends. Whatever has not exited after ``grace``
    seconds (a rank stuck after a failure) is killed."""
    if grace > 0:
        for w in workers:
            w.conn.close()
        deadline = time.monotonic() + grace
        for w in workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.proc.exitcode is None:
            w.proc.kill()
            w.proc.join(10)
        w.conn.close()
    workers.clear()


def run_on_ranks(world_size: int, fn: Callable | str, *args, timeout: float = 120.0, **kwargs) -> list:
    """One-shot: start a pool of ``world_size`` ranks, run ``fn`` once, close the pool."""
    with RankPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


_SHARED: dict[tuple, RankPool] = {}


def shared_rank_pool(world_size: int, **pool_kwargs) -> RankPool:
    """A process-wide pool per (world_size, options), so several test modules can share
    ranks; it lives until closed or until the interpreter exits."""
    key = (world_size, tuple(sorted(pool_kwargs.items())))
    pool = _SHARED.get(key)
    if pool is None or pool._closed:
        pool = _SHARED[key] = RankPool(world_size, **pool_kwargs)
    return pool


def rank_pool_fixture(world_size: int, *, scope: str = "module", shared: bool = False, **pool_kwargs):
    """Return a pytest fixture yielding a started :class:`RankPool`.

    In a test module: ``pool4 = rank_pool_fixture(4)`` then ``def test_x(pool4): ...``.
    ``shared=True`` hands out :func:`shared_rank_pool` (kept for the session) instead of a
    pool owned (and closed) by the fixture.
    """
    import pytest

    @pytest.fixture(scope=scope)
    def _rank_pool():
        if shared:
            yield shared_rank_pool(world_size, **pool_kwargs).start()
            return
        with RankPool(world_size, **pool_kwargs) as pool:
            yield pool

    _rank_pool.__name__ = f"rank_pool_{world_size}"
    return _rank_pool


rank_pool = rank_pool_fixture  # short alias: ``pool4 = multiproc.rank_pool(4)``
