"""Multi-rank test harness: a pool of real gloo ranks, started once and reused.

Design, in short:

* ``RankPool(n)`` starts ``n`` worker processes once; each initialises a gloo
  process group (rendezvous through a ``TCPStore`` hosted by the parent, so no
  port races and no dependence on rank 0 staying alive) and then serves
  ``pool.run(fn, *args, **kwargs)`` requests until the pool is closed.
  Importing torch costs seconds, so workers are forked from the stdlib
  *forkserver*, which imports torch, DTensor, transformers, pytest (and the
  modules given to :func:`set_preload`) once per test session; a fresh pool of
  8 ranks then starts in a fraction of a second instead of ~8 x 4 s. Each worker
  mirrors the parent's ``os.environ`` (the forkserver's own environment is a
  snapshot from its start), sets ``OMP_NUM_THREADS=1`` and
  ``torch.set_num_threads(1)``. As with any spawn/forkserver start, a *script*
  (not pytest) that makes a pool needs an ``if __name__ == "__main__":`` guard.
* Shipping functions to ranks: ``fn`` and its arguments are pickled *by
  reference* (no cloudpickle). While pickling, the parent records the module
  of every function and class it meets and sends ``(module name, file)`` hints
  along; a worker imports each module by name when that resolves to the same
  file, and otherwise loads the file under the same module name. So rank
  functions may live in the test module itself, even under
  ``pytest --import-mode=importlib`` where test modules are not importable by
  name. They must be module-level (no lambdas, no nested functions), and the
  test module must have no side effects at import. ``fn`` may also be a
  ``"package.module:qualname"`` string.
* Failure handling. If a rank raises, dies (``os._exit``, a signal) or does
  not answer within ``timeout``, ``run`` raises :class:`RankFailure` (or
  :class:`RankTimeout`) naming the ranks, with their tracebacks, exit codes and
  the tail of their output. Ranks still running after a failure get
  ``failure_grace`` seconds to answer (they are usually blocked in a
  collective), have their Python stacks dumped through ``faulthandler``
  (``SIGUSR1``), and are killed. **After any failure the whole pool is torn
  down and restarted transparently by the next ``run``**, so every ``run``
  starts from a fresh, consistent process group. Nothing blocks without a
  deadline: start (``start_timeout``), each run (``timeout``), collectives
  inside workers (the process group's ``pg_timeout``), and workers exit by
  themselves when the parent process goes away (``PR_SET_PDEATHSIG`` plus an
  owner-pid watch), so a killed test run leaves no ranks behind.
* Worker stdout/stderr go to per-rank log files; after each run the new output
  is echoed into the parent's stdout prefixed with ``[rank r]`` (so pytest shows
  it with a failing test), and failure messages carry its tail.

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

import atexit
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.util  # noqa: F401  (its atexit hook must be registered before ours)
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import wait as _wait_any
from typing import Any

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

# Modules the forkserver imports once, before forking workers. Extend with
# set_preload() (or FXPAR_RANKPOOL_PRELOAD="a,b") before the first pool starts.
_PRELOAD: list[str] = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "fxpar.testing.multiproc",
]
if importlib.util.find_spec("transformers") is not None:
    _PRELOAD.append("transformers")
_PRELOAD += [m for m in os.environ.get("FXPAR_RANKPOOL_PRELOAD", "").split(",") if m]

_OUTPUT_TAIL_CHARS = 4000


def set_preload(modules: Sequence[str]) -> None:
    """Add modules for the forkserver to import once (e.g. a model zoo).

    Only effective before the first pool of the process starts (the stdlib
    forkserver is started once per process); later calls are harmless no-ops.
    """
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


class RankFailure(RuntimeError):
    """One or more ranks raised, died or did not answer during ``RankPool.run``.

    Attributes: ``failures`` (rank -> traceback text or description),
    ``exit_codes`` (rank -> exit code of ranks that died by themselves),
    ``unanswered`` (ranks that never answered and were killed),
    ``results`` (per-rank results, ``None`` where a rank did not return).
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
        return sorted(set(self.failures) | set(self.exit_codes))

    def __reduce__(self):
        return (
            type(self),
            (str(self), self.failures, self.exit_codes, self.unanswered, self.results),
        )


class RankTimeout(RankFailure):
    """No rank failed, but ``unanswered`` ranks had not answered within the timeout."""


# --------------------------------------------------------------------------
# Shipping functions: pickling by reference plus module hints
# --------------------------------------------------------------------------


class _RecordingPickler(pickle.Pickler):
    """Pickles normally, recording the module of each function and class met."""

    def __init__(self, file, modules: set[str]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._modules = modules

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)):
            mod = getattr(obj, "__module__", None)
            if isinstance(mod, str):
                self._modules.add(mod)
                top = mod.partition(".")[0]
                if "." in mod and mod in sys.modules and top not in sys.modules:
                    # Registered under a dotted name whose package does not exist
                    # (a module loaded by path): plain pickle would try to import the
                    # package, so refer to the object by (module, file, qualname).
                    qualname = getattr(obj, "__qualname__", "")
                    if "<" not in qualname:
                        file = getattr(sys.modules[mod], "__file__", None)
                        return _import_global, (mod, file, qualname)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    """Resolves globals of modules already in ``sys.modules`` without importing their
    packages (a module loaded by path may sit under a package name that is absent)."""

    def find_class(self, module, name):
        mod = sys.modules.get(module)
        if mod is not None:
            try:
                obj: Any = mod
                for part in name.split("."):
                    obj = getattr(obj, part)
                return obj
            except AttributeError:
                pass
        return super().find_class(module, name)


def _loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def _module_hints(modules: set[str]) -> list[tuple[str, str | None]]:
    hints = []
    for name in sorted(modules):
        if name in ("builtins", "__main__", "__mp_main__") or name in sys.builtin_module_names:
            continue
        mod = sys.modules.get(name)
        hints.append((name, getattr(mod, "__file__", None)))
    return hints


def _pack_call(fn: Callable | str, args: tuple, kwargs: dict) -> bytes:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"function reference {fn!r} must look like 'package.module:qualname'")
    elif not callable(fn):
        raise TypeError(f"fn must be callable or a 'module:qualname' string, got {fn!r}")
    modules: set[str] = set()
    buf = io.BytesIO()
    try:
        _RecordingPickler(buf, modules).dump((fn, args, kwargs))
    except Exception as e:  # PicklingError, AttributeError (local objects), TypeError
        raise TypeError(
            f"cannot ship {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks: {e}. "
            "Rank functions and the classes of their arguments must be defined at module level "
            "(pickled by reference): no lambdas, nested functions or local classes."
        ) from e
    return pickle.dumps(("run", _module_hints(modules), buf.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)


def _same_file(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _ensure_parents(name: str, file: str) -> None:
    """Make the parent packages of ``name`` exist (empty namespaces if needed),
    so ``__import__("a.b.mod")`` (which pickle uses) resolves."""
    parts = name.split(".")
    directory = os.path.dirname(os.path.abspath(file))
    dirs = []
    for _ in parts[:-1]:
        dirs.append(directory)
        directory = os.path.dirname(directory)
    dirs.reverse()  # dirs[i] is the directory of package parts[: i + 1]
    for i in range(len(parts) - 1):
        pkg = ".".join(parts[: i + 1])
        if pkg in sys.modules:
            continue
        try:
            importlib.import_module(pkg)
            continue
        except Exception:
            pass
        mod = types.ModuleType(pkg)
        mod.__path__ = [dirs[i]]
        sys.modules[pkg] = mod
        if i:
            setattr(sys.modules[".".join(parts[:i])], parts[i], mod)


def _load_module(name: str, file: str | None) -> None:
    if name in sys.modules:
        return
    spec = None
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        spec = None
    if spec is not None and (file is None or _same_file(spec.origin, file)):
        importlib.import_module(name)
        return
    if file is None or not os.path.exists(file):
        importlib.import_module(name)  # let it raise a clear ImportError
        return
    # Not importable by name (e.g. a pytest test module under --import-mode=importlib):
    # load the parent's file under the parent's module name.
    _ensure_parents(name, file)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load module {name!r} from {file}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if "." in name:
        parent, _, leaf = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], leaf, mod)


def _import_global(module_name: str, file: str | None, qualname: str) -> Any:
    """Unpickling helper: ``module.qualname``, loading the module by path if needed."""
    _load_module(module_name, file)
    obj: Any = sys.modules[module_name]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_ref(ref: str) -> Callable:
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def rank_info() -> dict:
    """Small self-test function: this rank's identity (``"fxpar.testing.multiproc:rank_info"``)."""
    import torch.distributed as dist

    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
        "num_threads": __import__("torch").get_num_threads(),
    }


def _die_with_parent(parent_pid: int) -> None:
    """Make this worker go away when the process that owns the pool does.

    * The stdlib hands every forkserver child the forkserver's "alive" pipe, so the
      forkserver outlives its owner while any worker lives. Workers close it: the
      forkserver then exits with the owner, and
    * on Linux, PR_SET_PDEATHSIG kills the worker when its parent (the forkserver,
      or the owner under "spawn") exits, even if the worker is stuck holding the GIL;
    * a daemon thread also polls the owner's pid (other platforms, odd cases).
    """
    try:
        from multiprocessing import forkserver

        fd = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
        if fd is not None and getattr(forkserver._forkserver, "_forkserver_pid", None) is None:
            os.close(fd)
            forkserver._forkserver._forkserver_alive_fd = None
    except Exception:
        pass
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except Exception:
            pass
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(70)
    except PermissionError:
        pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="fxpar-watch-owner").start()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:
            pass


def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _worker_main(rank: int, world_size: int, conn, cfg: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    os.environ.clear()
    os.environ.update(cfg["env"])
    if cfg["log_path"]:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(cfg["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except Exception:
            pass
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    _die_with_parent(cfg["parent_pid"])

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        store = dist.TCPStore(
            cfg["store_host"],
            cfg["store_port"],
            is_master=False,
            timeout=timedelta(seconds=cfg["start_timeout"]),
        )
        dist.init_process_group(
            cfg["backend"],
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=cfg["pg_timeout"]),
        )
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if msg[0] == "stop":
            break
        _, hints, payload = msg
        try:
            for name, file in hints:
                _load_module(name, file)
            fn, args, kwargs = _loads(payload)
            if isinstance(fn, str):
                fn = _resolve_ref(fn)
            result = fn(*args, **kwargs)
            try:
                reply = ("ok", pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:
                raise TypeError(
                    f"rank {rank}: the return value of {getattr(fn, '__qualname__', fn)} cannot be "
                    f"pickled ({e}); return plain data or detached CPU tensors"
                ) from e
        except BaseException as e:  # SystemExit included: report, keep serving
            reply = ("err", f"{type(e).__name__}: {e}", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _send(conn, reply)
        except (OSError, EOFError):
            break
    try:
        dist.destroy_process_group()
    except Exception:
        pass


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exit code {code}"


_SECONDARY_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out waiting",
    "timed out",
    "Timeout",
)


def _is_secondary(summary: str) -> bool:
    """Errors a rank typically raises because *another* rank failed mid-collective."""
    return any(m in summary for m in _SECONDARY_MARKERS)


def _fmt_ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _fn_name(fn) -> str:
    if isinstance(fn, str):
        return fn
    mod = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{mod}:{qual}" if mod else qual


class _Worker:
    __slots__ = ("rank", "proc", "conn", "log_path", "log_offset")

    def __init__(self, rank, proc, conn, log_path):
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.log_path = log_path
        self.log_offset = 0

    def read_new_output(self) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                data = f.read()
        except OSError:
            return ""
        return _drop_watchdog_stack(data.decode("utf-8", errors="replace"))

    def mark_output(self) -> None:
        if self.log_path:
            try:
                self.log_offset = os.path.getsize(self.log_path)
            except OSError:
                self.log_offset = 0


def _idle_worker_broken(w: _Worker) -> bool:
    """An idle worker is broken if it exited or its pipe is readable (EOF: it died;
    the exit status may not have been reported yet)."""
    try:
        return not w.proc.is_alive() or w.conn.poll(0)
    except (OSError, EOFError, ValueError):
        return True


def _drop_watchdog_stack(text: str) -> str:
    """Remove the harness's own owner-watch thread from faulthandler dumps."""
    if "_watch_parent" not in text:
        return text
    blocks = text.split("\n\n")
    return "\n\n".join(b for b in blocks if not ("_watch_parent" in b and b.lstrip().startswith("Thread 0x")))


def _kill_workers(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            if w.proc.is_alive():
                w.proc.kill()
        except Exception:
            pass
    for w in workers:
        try:
            w.proc.join(timeout=10)
        except Exception:
            pass
        try:
            w.conn.close()
        except Exception:
            pass
        try:
            w.proc.close()
        except Exception:
            pass


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

    The pool starts lazily (first ``run``) or eagerly with ``start()`` / ``with``.
    After a :class:`RankFailure` the pool tears itself down and the next ``run``
    restarts it (``pool.restarts`` counts this). Not thread-safe across concurrent runs
    (calls are serialised by a lock).
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
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self.pg_timeout = float(pg_timeout)
        self.start_timeout = float(start_timeout)
        self.failure_grace = float(failure_grace)
        self.backend = backend
        if start_method is None:
            start_method = (
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
            )
        self.start_method = start_method
        self.capture_output = capture_output
        self.echo_output = echo_output
        self.extra_env = dict(env or {})
        self.restarts = 0  # incarnations started after the first
        self.start_seconds: list[float] = []  # wall time of each (re)start, for reporting
        self._workers: list[_Worker] = []
        self._store = None
        self._ready = False
        self._closed = False
        self._incarnation = 0
        self._lock = threading.RLock()
        self._tmpdir = tempfile.mkdtemp(prefix=f"fxpar-rankpool{world_size}-")
        self._finalizer = weakref.finalize(self, RankPool._finalize, self._workers, self._tmpdir)
        _LIVE_POOLS.add(self)

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("ready" if self._ready else "idle")
        return f"RankPool(world_size={self.world_size}, {state}, restarts={self.restarts})"

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def start(self) -> RankPool:
        """Start the workers (if needed) and wait until every rank has joined the group."""
        with self._lock:
            self._check_open()
            if not self._ready:
                self._spawn()
                self._wait_ready()
        return self

    def restart(self) -> None:
        with self._lock:
            self._teardown()
            self.start()

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the log directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                try:
                    _send(w.conn, ("stop",))
                except Exception:
                    pass
            deadline = time.monotonic() + 5.0
            for w in self._workers:
                w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            self._teardown()
            self._finalizer()

    @staticmethod
    def _finalize(workers: list[_Worker], tmpdir: str) -> None:
        _kill_workers(workers)
        workers.clear()
        shutil.rmtree(tmpdir, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("RankPool is closed")

    def _teardown(self) -> None:
        _kill_workers(self._workers)
        for w in self._workers:
            if w.log_path:
                try:
                    os.unlink(w.log_path)
                except OSError:
                    pass
        self._workers.clear()
        self._store = None
        self._ready = False

    def _spawn(self) -> None:
        import torch.distributed as dist

        self._teardown()
        t0 = time.monotonic()
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            _start_forkserver(ctx)
        if self._incarnation:
            self.restarts += 1
        self._incarnation += 1
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.start_timeout),
        )
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = "lo"
        env.update(self.extra_env)
        for rank in range(self.world_size):
            log_path = (
                os.path.join(self._tmpdir, f"rank{rank}.{self._incarnation}.log")
                if self.capture_output
                else None
            )
            wenv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.world_size))
            cfg = {
                "env": wenv,
                "log_path": log_path,
                "parent_pid": os.getpid(),
                "store_host": "127.0.0.1",
                "store_port": self._store.port,
                "backend": self.backend,
                "pg_timeout": self.pg_timeout,
                "start_timeout": self.start_timeout,
            }
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, child_conn, cfg),
                name=f"fxpar-rank{rank}",
                daemon=False,
            )
            proc.start()
            child_conn.close()
            self._workers.append(_Worker(rank, proc, parent_conn, log_path))
        self._spawn_t0 = t0

    def _wait_ready(self) -> None:
        res = self._collect(set(range(self.world_size)), self.start_timeout, expect="ready")
        ok, errors, exit_codes, pending = res
        if errors or exit_codes or pending:
            outputs = {w.rank: w.read_new_output() for w in self._workers}
            self._teardown()
            lines = [f"RankPool({self.world_size}) failed to start ({self.backend}):"]
            for r, (summary, _tb) in sorted(errors.items()):
                lines.append(f"  rank {r}: {summary}")
            for r, code in sorted(exit_codes.items()):
                lines.append(f"  rank {r}: died, {_describe_exit(code)}")
            if pending:
                lines.append(f"  {_fmt_ranks(pending)}: not ready within {self.start_timeout:.0f} s")
            for r, (_s, tb) in sorted(errors.items()):
                lines.append(f"\n---- rank {r} traceback ----\n{tb.rstrip()}")
            for r in sorted(set(exit_codes) | set(pending)):
                if outputs.get(r):
                    lines.append(
                        f"\n---- rank {r} output (tail) ----\n{outputs[r][-_OUTPUT_TAIL_CHARS:].rstrip()}"
                    )
            if exit_codes and not any(outputs.get(r) for r in exit_codes):
                lines.append(
                    "\nWorkers that die before writing anything usually failed while re-importing the "
                    "main module (a script needs `if __name__ == '__main__':`) or the harness itself; "
                    "their stderr went to this process's stderr."
                )
            cls = RankTimeout if pending and not (errors or exit_codes) else RankFailure
            raise cls(
                "\n".join(lines),
                failures={r: tb for r, (_s, tb) in errors.items()},
                exit_codes=exit_codes,
                unanswered=pending,
            )
        self._ready = True
        self.start_seconds.append(time.monotonic() - self._spawn_t0)

    # -- running -----------------------------------------------------------

    def run(self, fn: Callable | str, *args, timeout: float | None = None, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` is a module-level function (or ``"module:qualname"``); see the module
        docstring for how it reaches the workers. Raises :class:`RankFailure` if any
        rank raises or dies, :class:`RankTimeout` if some rank has not answered after
        ``timeout`` seconds (default: the pool's). After either, the pool is torn
        down and the next ``run`` restarts it. ``timeout`` is the harness's own
        keyword: it is never passed on to ``fn``.
        """
        timeout = self.timeout if timeout is None else float(timeout)
        message = _pack_call(fn, args, kwargs)  # fails here, pool untouched, if unpicklable
        with self._lock:
            self._check_open()
            if self._ready and any(_idle_worker_broken(w) for w in self._workers):
                self._teardown()  # a worker died while idle: start afresh
            if not self._ready:
                self._spawn()
                self._wait_ready()
            workers = self._workers
            for w in workers:
                w.mark_output()
            try:
                send_failed: dict[int, int | None] = {}
                for w in workers:
                    try:
                        w.conn.send_bytes(message)
                    except (OSError, EOFError):
                        w.proc.join(timeout=1.0)
                        send_failed[w.rank] = w.proc.exitcode
                pending = set(range(self.world_size)) - set(send_failed)
                ok, errors, exit_codes, pending = self._collect(pending, timeout, expect="result")
                exit_codes.update(send_failed)
            except BaseException:
                # e.g. KeyboardInterrupt or pytest-timeout inside the wait: never leave ranks behind
                self._teardown()
                raise
            outputs = {w.rank: w.read_new_output() for w in workers}
            if not errors and not exit_codes and not pending:
                self._echo(outputs)
                return [ok[r] for r in range(self.world_size)]
            # Failure: dump the stacks of ranks still running, then tear everything down.
            alive_pending = [workers[r] for r in sorted(pending) if workers[r].proc.is_alive()]
            if alive_pending and self.capture_output:
                self._dump_stacks(alive_pending, outputs)
            self._teardown()
            self._echo(outputs)
            raise self._failure(fn, timeout, ok, errors, exit_codes, pending, outputs)

    @staticmethod
    def _dump_stacks(workers: list[_Worker], outputs: dict[int, str]) -> None:
        """SIGUSR1 makes faulthandler write each rank's Python stacks to its log;
        wait (at most 1 s) until every log has grown and stopped growing."""
        sizes = {}
        for w in workers:
            sizes[w.rank] = len(outputs.get(w.rank, ""))
            try:
                os.kill(w.proc.pid, signal.SIGUSR1)
            except OSError:
                sizes.pop(w.rank)
        deadline = time.monotonic() + 1.0
        last: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.05)
            done = True
            for w in workers:
                if w.rank not in sizes:
                    continue
                outputs[w.rank] = w.read_new_output()
                n = len(outputs[w.rank])
                if n <= sizes[w.rank] or last.get(w.rank) != n:
                    done = False
                last[w.rank] = n
            if done:
                break

    def _collect(self, pending: set[int], timeout: float, expect: str):
        """Wait for one message from each pending rank, watching for deaths.

        Returns (ok: rank->value, errors: rank->(summary, traceback), exit_codes, still_pending).
        After the first failure the remaining ranks only get ``failure_grace`` seconds.
        """
        ok: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}
        exit_codes: dict[int, int | None] = {}
        pending = set(pending)
        workers = self._workers
        deadline = time.monotonic() + timeout
        failed_at = None

        def died(r: int) -> None:
            workers[r].proc.join(timeout=2.0)
            exit_codes[r] = workers[r].proc.exitcode
            pending.discard(r)

        def receive(r: int) -> None:
            try:
                msg = pickle.loads(workers[r].conn.recv_bytes())
            except (EOFError, OSError):
                died(r)
                return
            pending.discard(r)
            kind = msg[0]
            if kind == "ok":
                try:
                    ok[r] = _loads(msg[1])
                except Exception as e:
                    errors[r] = (
                        f"result could not be unpickled in the parent: {type(e).__name__}: {e}",
                        traceback.format_exc(),
                    )
            elif kind == "ready":
                ok[r] = msg[1]
            elif kind in ("err", "init_error"):
                if kind == "init_error":
                    tb = msg[1]
                    summary = "process-group initialisation failed: " + tb.strip().splitlines()[-1]
                else:
                    summary, tb = msg[1], msg[2]
                errors[r] = (summary, tb)
            else:  # pragma: no cover - protocol error
                errors[r] = (f"unexpected message {kind!r} while waiting for {expect}", "")

        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + self.failure_grace)
            if now >= limit:
                break
            by_conn = {workers[r].conn: r for r in pending}
            by_sentinel = {workers[r].proc.sentinel: r for r in pending}
            ready = _wait_any(list(by_conn) + list(by_sentinel), timeout=limit - now)
            conns_ready = [by_conn[o] for o in ready if o in by_conn]
            dead = [by_sentinel[o] for o in ready if o in by_sentinel]
            for r in conns_ready:
                if r in pending:
                    receive(r)
            for r in dead:
                if r not in pending:
                    continue
                # A reply may have been written just before exiting.
                try:
                    has_msg = workers[r].conn.poll(0)
                except (EOFError, OSError):
                    has_msg = False
                if has_msg:
                    receive(r)
                if r in pending:
                    died(r)
            if failed_at is None and (errors or exit_codes):
                failed_at = time.monotonic()
        return ok, errors, exit_codes, pending

    def _failure(self, fn, timeout, ok, errors, exit_codes, pending, outputs) -> RankFailure:
        name = _fn_name(fn)
        n = self.world_size
        failed = sorted(set(errors) | set(exit_codes))
        lines = []
        if failed:
            # Headline: a rank that died, else the first error that is not merely a
            # peer noticing the failure (gloo "connection reset/closed", timeouts).
            primary = list(exit_codes) + [r for r in errors if not _is_secondary(errors[r][0])]
            first = primary[0] if primary else next(iter(errors))
            what = errors[first][0] if first in errors else "died, " + _describe_exit(exit_codes[first])
            lines.append(f"{_fmt_ranks(failed)} of {n} failed running {name}; rank {first}: {what}")
        else:
            lines.append(
                f"timed out after {timeout:g} s running {name}: {_fmt_ranks(pending)} of {n} had not answered"
            )
        for r in sorted(errors):
            note = " (likely a consequence of another rank's failure)" if _is_secondary(errors[r][0]) else ""
            lines.append(f"  rank {r}: raised {errors[r][0]}{note}")
        for r in sorted(exit_codes):
            lines.append(f"  rank {r}: died, {_describe_exit(exit_codes[r])}")
        if pending:
            why = (
                f"no answer within {self.failure_grace:g} s after the failure (probably blocked in a collective)"
                if failed
                else f"no answer within {timeout:g} s"
            )
            lines.append(f"  {_fmt_ranks(pending)}: {why}; killed")
        if ok:
            lines.append(f"  {_fmt_ranks(ok)}: returned normally")
        lines.append("The pool was torn down; the next run() restarts it.")
        # Tracebacks: genuine failures first, peers' follow-on errors last.
        for r in sorted(errors, key=lambda r: (_is_secondary(errors[r][0]), r)):
            lines.append(f"\n---- rank {r} traceback ----\n{errors[r][1].rstrip()}")
        for r in sorted(set(exit_codes) | set(pending) | set(errors)):
            out = outputs.get(r, "")
            if out.strip():
                label = "output and stacks" if r in pending else "output"
                lines.append(f"\n---- rank {r} {label} (tail) ----\n{out[-_OUTPUT_TAIL_CHARS:].rstrip()}")
        cls = RankTimeout if not failed else RankFailure
        results = [ok.get(r) for r in range(n)]
        return cls(
            "\n".join(lines),
            failures={r: tb for r, (_s, tb) in errors.items()},
            exit_codes=exit_codes,
            unanswered=pending,
            results=results,
        )

    def _echo(self, outputs: dict[int, str]) -> None:
        if not self.echo_output:
            return
        chunks = []
        for r in sorted(outputs):
            text = outputs[r]
            if text:
                chunks.append("".join(f"[rank {r}] {line}\n" for line in text.splitlines()))
        if chunks:
            sys.stdout.write("".join(chunks))
            sys.stdout.flush()


_forkserver_lock = threading.Lock()


def _start_forkserver(ctx) -> None:
    """Start the process-wide forkserver with our preload list and OMP_NUM_THREADS=1."""
    from multiprocessing import forkserver

    with _forkserver_lock:
        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None:
            return
        preload = list(_PRELOAD)
        if "pytest" in sys.modules:  # test modules loaded by the workers import it
            preload.append("pytest")
        ctx.set_forkserver_preload(preload)
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old


def run_on_ranks(world_size: int, fn: Callable | str, *args, timeout: float = 120.0, **kwargs) -> list:
    """One-shot: start a pool of ``world_size`` ranks, run ``fn`` once, close the pool."""
    with RankPool(world_size, timeout=timeout) as pool:
        return pool.run(fn, *args, **kwargs)


# --------------------------------------------------------------------------
# pytest integration
# --------------------------------------------------------------------------

_SHARED: dict[tuple, RankPool] = {}


def shared_rank_pool(world_size: int, **pool_kwargs) -> RankPool:
    """A process-wide pool per (world_size, options), closed at interpreter exit.

    Lets several test modules share ranks instead of each starting its own.
    """
    key = (world_size, tuple(sorted(pool_kwargs.items())))
    pool = _SHARED.get(key)
    if pool is None or pool._closed:
        pool = _SHARED[key] = RankPool(world_size, **pool_kwargs)
    return pool


_LIVE_POOLS: weakref.WeakSet[RankPool] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    """Close pools left open at exit. Registered after multiprocessing.util's own
    exit hook (imported above), so it runs first: that hook joins non-daemonic
    children, which would wait forever for idle workers."""
    for pool in list(_LIVE_POOLS):
        try:
            pool.close()
        except Exception:
            pass


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
