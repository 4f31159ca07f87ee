"""Which peer died: a heartbeat per rank in the rendezvous store, read when a wait fails.

A rank killed outright (SIGKILL, out of memory, a lost node) says nothing; its peers see only a closed
socket ("Connection closed by peer [10.0.0.3]:41727") or a timeout, from whichever collective or
pipeline receive they were in. So that a failure names the rank that is gone:

* :func:`start` (``fxpar.compile`` and ``fxpar.launch.init_distributed`` call it) runs a daemon thread
  that increments ``beat/<rank>`` in the process group's own store (its own client connection, so a
  blocked store call of the main thread never delays it) every ``interval`` seconds;
* :func:`guard` (a context manager; :func:`guarded` the decorator) around every fxpar entry point that
  communicates (``CompiledModel.step`` / ``__call__`` / ``full_state_dict``, ``compile``, checkpoint
  barriers, ``fxpar train``'s saves) turns a communication failure into :class:`PeerFailure`, after
  :func:`diagnose` has watched the heartbeats for a few intervals: a rank whose counter stopped, and
  that did not report an error of its own, is named as gone. A rank leaving through ``guard`` writes
  ``failed/<rank>`` first (its error, one line, or "gave up waiting"), so its peers name it as failed
  or as a fellow waiter rather than as gone.
* The first finding of a gone rank is also written as ``verdict``, which every heartbeat thread reads:
  where the store lives in rank 0's process (launchers other than torchrun's agent), rank 0 exiting
  takes the store with it, and the ranks that diagnose after that still know which rank died first.

Keys live under ``fxpar/live/<torchrun restart count>/`` of the store's root, so a job torchrun
restarts never reads the heartbeats of the attempt before. Without a TCP store (a file store, a single
process) nothing starts and a failure names the ranks of the whole world instead.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import threading
import time

import torch.distributed as dist

from fxpar.ir.errors import FxparError
from fxpar.ir.options import run_options

__all__ = ["PeerFailure", "diagnose", "guard", "guarded", "start", "stop"]


class PeerFailure(FxparError):
    """A rank gave up waiting because a peer died, failed or stopped answering; the message names it.
    ``gone``: ranks whose heartbeat stopped; ``failed``: {rank: error} of ranks that reported one."""

    def __init__(self, message: str, *, gone=(), failed=None):
        self.gone, self.failed = list(gone), dict(failed or {})
        super().__init__(message)


class _Heart:
    def __init__(self, store, address: str, rank: int, world: int, interval: float):
        self.store, self.address, self.rank, self.world, self.interval = store, address, rank, world, interval
        self.stopped = threading.Event()
        self.verdict = ""  # the first diagnosis any rank wrote, kept here in case the store dies after
        self.thread = threading.Thread(target=self._beat, name=f"fxpar-heartbeat-{rank}", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.store.add(f"beat/{self.rank}", 1)
                if not self.verdict and self.store.check(["verdict"]):
                    self.verdict = self.store.get("verdict").decode(errors="replace")
            except Exception:  # the store is gone (its host died): diagnose() will say so
                return
            self.stopped.wait(self.interval)


_heart: _Heart | None = None
_lock = threading.Lock()


def _root_store():
    """(root store of the default group, "host:port" or "") without the default group's key prefixes."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store, f"{store.host}:{store.port}"
    return store, ""


def start(interval: float | None = None) -> bool:
    """Start this process's heartbeat (once per process group; a no-op without one, on one rank, or
    without a TCP store). ``interval``: seconds between beats (default: ``FXPAR_HEARTBEAT``, else 0.5;
    0 turns the heartbeat off)."""
    global _heart
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return False
    interval = float(interval) if interval is not None else run_options().heartbeat
    if interval <= 0:  # FXPAR_HEARTBEAT=0: no heartbeat (failures then name the group's ranks only)
        return False
    with _lock:
        rank, world = dist.get_rank(), dist.get_world_size()
        if _heart is not None and not _heart.stopped.is_set() and (_heart.rank, _heart.world) == (rank, world):
            return True
        stop()
        try:
            root, address = _root_store()
        except (RuntimeError, ValueError):
            return False
        if not address:
            return False
        host, port = address.rsplit(":", 1)
        # a client of its own: a main-thread store call that blocks (a rendezvous wait) holds its
        # connection's lock, and the heartbeat must not wait for it; a short timeout, so that a store whose
        # host died is noticed in seconds
        try:
            client = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=datetime.timedelta(seconds=max(2.0, 4 * interval)))
        except (RuntimeError, ValueError):  # no second connection to the store: run without a heartbeat
            return False
        prefix = f"fxpar/live/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        _heart = _Heart(dist.PrefixStore(prefix, client), address, rank, world, interval)
        atexit.unregister(stop)
        atexit.register(stop)  # at exit, before the store client is torn down
        return True


def stop() -> None:
    """Stop the heartbeat (a rank that leaves on purpose; the next :func:`start` begins again) and wait
    for its thread: a daemon thread still inside a store call when the interpreter exits takes its C++
    store client down mid-call, which aborts the process ("terminate called without an active
    exception"). Also run at exit."""
    global _heart
    if _heart is not None:
        heart, _heart = _heart, None
        heart.stopped.set()
        heart.thread.join(timeout=max(2.0, 4 * heart.interval))


def _read(store, ranks) -> tuple[dict[int, int], dict[int, str]]:
    beats = {r: int(store.add(f"beat/{r}", 0)) for r in ranks}
    failed = {}
    for r in ranks:
        if store.check([f"failed/{r}"]):
            failed[r] = store.get(f"failed/{r}").decode(errors="replace")
    return beats, failed


def diagnose(ranks=None, *, watch: float | None = None) -> tuple[list[int], dict[int, str], str]:
    """(ranks gone, {rank: error} of ranks that failed, a sentence saying so) among ``ranks`` (default:
    the world, this rank left out). Watches the heartbeats for ``watch`` seconds (default 4 intervals,
    at least 1.5 s): a counter that does not move belongs to a rank that is dead or frozen."""
    heart = _heart
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = [r for r in (range(dist.get_world_size()) if ranks is None else ranks) if r != me]
    if heart is None:
        return [], {}, f"no heartbeat runs here (no TCP store), so which of ranks {ranks} failed is unknown"
    watch = max(1.5, 4 * heart.interval) if watch is None else watch
    try:
        before, _ = _read(heart.store, ranks)
        time.sleep(watch)
        after, failed = _read(heart.store, ranks)
    except Exception as e:
        lost = (f"the rendezvous store at {heart.address} does not answer ({type(e).__name__}): the process that "
                "hosts it is gone (rank 0, unless torchrun's agent hosts the store)")
        if heart.verdict:  # a peer's diagnosis, read before the store went away
            return [], {}, f"{heart.verdict} (a peer's finding); then {lost}"
        return [], {}, lost
    gone = [r for r in ranks if after[r] == before[r] and r not in failed]
    parts = []
    if gone:
        parts.append(f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} "
                     f"{'are' if len(gone) > 1 else 'is'} gone (no heartbeat for {watch:.1f} s: killed, crashed or "
                     "frozen)")
    parts += [f"rank {r} failed: {msg}" for r, msg in sorted(failed.items()) if msg != _GAVE_UP]
    waiting = [r for r, msg in sorted(failed.items()) if msg == _GAVE_UP]
    if waiting:
        parts.append(f"rank{'s' * (len(waiting) > 1)} {', '.join(map(str, waiting))} gave up waiting too")
    if not parts:
        parts.append(f"every other rank is alive and none reported an error (one of ranks {ranks} is stuck "
                     "or waits elsewhere)")
    return gone, failed, "; ".join(parts)


_GAVE_UP = "gave up waiting"  # the mark of a rank that failed only because a peer did


def _mark_failed(error: BaseException | None) -> None:
    heart = _heart
    if heart is None:
        return
    text = _GAVE_UP if error is None else \
        f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    with contextlib.suppress(Exception):
        heart.store.set(f"failed/{heart.rank}", text[:300])


def _publish(sentence: str) -> None:
    """Write the first finding of a dead rank for the peers that diagnose later; where this process may
    host the store (rank 0 outside torchrun's agent), stay two beats so their heartbeats can read it."""
    heart = _heart
    if heart is None:
        return
    with contextlib.suppress(Exception):
        heart.store.compare_set("verdict", "", sentence)
        if heart.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            time.sleep(2 * heart.interval + 0.2)


_TRANSPORT_WORDS = ("gloo", "Connection closed", "Connection reset", "Connection refused", "Timed out",
                    "timed out", "NCCL", "Broken pipe", "TCPStore")


def _is_communication_failure(error: BaseException) -> bool:
    """A wait on peers that failed: torch's distributed errors, or a backend's RuntimeError (gloo's closed
    connections and timeouts), also when fxpar's own CollectiveError or PipelineError wraps one. A
    CollectiveError about shapes or groups (raised before communicating) is not one."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, dist.DistError):
            return True
        if isinstance(error, RuntimeError) and any(w in str(error) for w in _TRANSPORT_WORDS):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class guard:  # noqa: N801 (a context manager named like one)
    """Around code that waits for peers: a communication failure becomes :class:`PeerFailure` naming
    the rank that died (see the module docstring); any other error is re-raised as it is, after this
    rank told its peers about it. ``what``: what this rank was doing ("step", "a checkpoint barrier")."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not isinstance(error, Exception) or isinstance(error, PeerFailure):
            return False
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return False
        if not _is_communication_failure(error):
            _mark_failed(error)
            return False
        gone, failed, sentence = diagnose()
        _mark_failed(None)
        if gone:
            _publish(sentence)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PeerFailure(f"rank {dist.get_rank()} of {dist.get_world_size()} gave up in {self.what}: {sentence}. "
                          f"What it saw: {type(error).__name__}: {first}", gone=gone, failed=failed) from error


def guarded(what: str):
    """Decorator form of :class:`guard` for methods (a fresh guard per call)."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with guard(what):
                return fn(*args, **kwargs)
        return inner
    return wrap
