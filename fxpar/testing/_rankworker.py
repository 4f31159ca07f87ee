"""One rank process of :mod:`fxpar.testing.multiproc`: shipping calls, and both ends of its pipe.

Shipping. Calls and results are pickled by reference (no cloudpickle), with one
twist: every module-level function and class whose module has a file is pickled as
``_import_global(module, file, qualname)``. The receiving process imports the module
by name when that finds the same file, and otherwise loads the file under the same
name. So rank functions and the classes of their arguments and results may live in
a test module that is not importable by name (``pytest --import-mode=importlib``),
even one registered under a dotted name whose package does not exist. Lambdas,
nested functions and local classes cannot be shipped.

Protocol. The owner sends one pickled ``(fn, args, kwargs)`` per call; the rank
answers ``("ok", result)`` or ``("err", summary, traceback)``, and once ``("ok", None)``
after joining the process group. :class:`RankProcess` (the owner's handle) reports a
rank that died, seen as EOF on the pipe, as ``("died", exit code)``.

Rank side. :func:`serve` redirects the rank's output to its log file, arranges to die
with the owner, joins the gloo process group through the owner's ``TCPStore`` and
answers calls until its pipe closes (the owner kills its ranks; EOF means the owner is gone).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib
import importlib.util
import io
import os
import pickle
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any


class _ByReference(pickle.Pickler):
    """Pickles module-level functions and classes as ``_import_global(module, file, qualname)``."""

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and obj is not _import_global:
            file = getattr(sys.modules.get(obj.__module__), "__file__", None)
            if file and "<" not in obj.__qualname__:
                return _import_global, (obj.__module__, file, obj.__qualname__)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ByReference(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def pack_call(fn: Callable | str, args: tuple, kwargs: dict) -> bytes:
    """The message that makes each rank call ``fn(*args, **kwargs)``; raises in the caller
    if ``fn`` or an argument cannot be shipped."""
    if not (":" in fn if isinstance(fn, str) else callable(fn)):
        raise TypeError(f"fn must be a function or a 'package.module:qualname' string, got {fn!r}")
    try:
        return dumps((fn, args, kwargs))
    except Exception as e:  # PicklingError, AttributeError (local objects), TypeError
        raise TypeError(
            f"cannot ship {getattr(fn, '__qualname__', fn)!r} and its arguments to the ranks: {e}. "
            "Rank functions and the classes of their arguments must be defined at module level "
            "(pickled by reference): no lambdas, nested functions or local classes."
        ) from e


def _load_module(name: str, file: str | None) -> types.ModuleType:
    """``sys.modules[name]``, imported by name if that finds ``file`` (or no file is
    given), else loaded from ``file`` under ``name``."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:  # e.g. its package does not exist
        spec = None
    if file is None or (spec and spec.origin and os.path.realpath(spec.origin) == os.path.realpath(file)):
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_global(module_name: str, file: str | None, qualname: str) -> Any:
    """Unpickling helper (and resolver of ``"module:qualname"``): ``module.qualname``."""
    obj: Any = _load_module(module_name, file)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@dataclasses.dataclass
class RankProcess:
    """The owner's handle on one rank: its process, pipe and log file."""

    rank: int
    proc: BaseProcess
    conn: Connection
    log_path: str | None
    log_offset: int = 0

    @classmethod
    def start(cls, ctx, rank: int, log_path: str | None, **config) -> RankProcess:
        """Start rank ``rank`` of a pool; ``config``: the other arguments of :func:`serve`."""
        if log_path:
            open(log_path, "wb").close()  # there even if the rank dies before opening it
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(
            target=serve,
            args=(child_conn,),
            kwargs=dict(config, rank=rank, log_path=log_path),
            name=f"fxpar-rank{rank}",
            daemon=True,  # terminated, not joined, at interpreter exit
        )
        proc.start()
        child_conn.close()
        return cls(rank, proc, conn, log_path)

    def send(self, message: bytes) -> None:
        with contextlib.suppress(OSError):  # it died: receive() will say so
            self.conn.send_bytes(message)

    def receive(self) -> tuple:
        """The rank's answer: ``("ok", value)``, ``("err", summary, traceback)`` or ``("died", exit code)``."""
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.proc.join(2)
            return ("died", self.proc.exitcode)
        try:
            return pickle.loads(data)
        except Exception as e:
            return (
                "err",
                f"the result cannot be unpickled here: {type(e).__name__}: {e}",
                traceback.format_exc(),
            )

    def broken(self) -> bool:
        """An idle rank is broken if it exited or its pipe is readable (EOF)."""
        return not self.proc.is_alive() or self.conn.poll(0)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.conn.close()

    def log_size(self) -> int:
        return os.path.getsize(self.log_path) if self.log_path else 0

    def new_output(self) -> str:
        """What the rank wrote since the last call."""
        if not self.log_path:
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        self.log_offset += len(data)
        return data.decode("utf-8", errors="replace")


def dump_stacks(ranks: list[RankProcess]) -> None:
    """SIGUSR1 makes faulthandler write each rank's Python stacks to its log; wait
    (at most 1 s) until every log has grown and stopped growing."""
    before = {r.rank: r.log_size() for r in ranks}
    for r in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.proc.pid, signal.SIGUSR1)
    last = None
    for _ in range(20):
        time.sleep(0.05)
        sizes = {r.rank: r.log_size() for r in ranks}
        if sizes == last and all(sizes[r] > before[r] for r in sizes):
            break
        last = sizes


def _die_with_owner(owner_pid: int) -> None:
    """Exit when the pool's owner does (Linux). Every forkserver child inherits the
    owner's end of the forkserver's "alive" pipe; closing it lets the forkserver exit
    with the owner, and PR_SET_PDEATHSIG then kills this worker with the forkserver
    (under "spawn", directly with the owner)."""
    if forkserver._forkserver._forkserver_alive_fd is not None:
        os.close(forkserver._forkserver._forkserver_alive_fd)
        forkserver._forkserver._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        os.kill(owner_pid, 0)  # gone before the line above took effect?
    except ProcessLookupError:
        os._exit(70)


def _reply(conn, kind: str, *payload) -> None:
    try:
        data = dumps((kind, *payload))
    except Exception as e:
        data = dumps(
            ("err", f"the result cannot be pickled: {type(e).__name__}: {e}", traceback.format_exc())
        )
    conn.send_bytes(data)


def serve(
    conn,
    *,
    rank: int,
    world_size: int,
    env: dict[str, str],
    log_path: str | None,
    store_port: int,
    backend: str,
    start_timeout: float,
    pg_timeout: float,
    owner_pid: int,
) -> None:
    """A rank's life: set up, join the process group, then run calls until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the owner's business
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    if log_path:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the owner's "where are you stuck?"
    _die_with_owner(owner_pid)

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=start_timeout)
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
        )
    except BaseException as e:
        _reply(
            conn,
            "err",
            f"process-group initialisation failed: {type(e).__name__}: {e}",
            traceback.format_exc(),
        )
        return
    _reply(conn, "ok", None)

    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args, kwargs = pickle.loads(message)
            if isinstance(fn, str):
                module, _, qualname = fn.partition(":")
                fn = _import_global(module, None, qualname)
            reply = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # SystemExit included: report it, keep serving
            reply = ("err", f"{type(e).__name__}: {e}", traceback.format_exc())
        sys.stdout.flush()
        _reply(conn, *reply)
