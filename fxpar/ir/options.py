"""fxpar's own environment variables, read in one place: :class:`RunOptions`.

Reads: ``os.environ`` (only the ``FXPAR_*`` names of :class:`RunOptions`' fields; torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*`` and ``TORCHELASTIC_*`` are the launcher's, read where they are
used). Writes: nothing.

Every variable is one typed field with its default; :meth:`RunOptions.from_env` parses and checks them all,
and a value it cannot read raises :class:`~fxpar.ir.errors.OptionError` naming the variable, the value and
what is accepted. :func:`run_options` is what product code calls: it parses once per distinct set of
values (a test's ``monkeypatch.setenv`` after import is seen at the next call, without a refresh step).
Where a function takes the value as an argument (``fxpar.compile(timeout=)``), the entry point resolves
it here once and passes it down. The table of every variable is in docs/launch.md ("Environment
variables"); ``tests/ir/test_options.py`` keeps the table, this class and the product code's names equal.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from fxpar.ir.errors import OptionError

__all__ = ["RunOptions", "kernels_triton", "run_options"]

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _switch(raw: str) -> bool:
    low = raw.lower()
    if low in _ON or low in _OFF:
        return low in _ON
    raise ValueError


def _tristate(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError
    return raw == "1"


def _number(kind: type, low: float, strict: bool) -> Callable[[str], float]:
    def parse(raw: str):
        value = kind(raw)
        if not (value > low if strict else value >= low):  # (nan fails both)
            raise ValueError
        return value
    return parse


def _cache_dir(raw: str) -> Path | None:
    """A switch (on: ``~/.cache/fxpar/programs``) or a directory."""
    low = raw.lower()
    if low in _ON or low in _OFF:
        return Path.home() / ".cache" / "fxpar" / "programs" if low in _ON else None
    return Path(raw).expanduser()


def _one_of(*words: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.strip() not in words:
            raise ValueError
        return raw.strip()
    return parse


def _names(raw: str) -> frozenset[str]:
    return frozenset(s.strip() for s in raw.split(",") if s.strip())


def _var(name: str, default, parse: Callable[[str], object], accepts: str, readers: str):
    """A field read from ``name``: unset or empty gives ``default``; ``parse`` raises ValueError on a value
    outside ``accepts`` (the words the error shows); ``readers``: the modules that use it (for the docs)."""
    return field(default=default, metadata={"env": name, "parse": parse, "accepts": accepts, "readers": readers})


_SWITCH = "1/true/yes/on or 0/false/no/off"


@dataclass(frozen=True)
class RunOptions:
    """fxpar's settings from the environment, one field per variable (the field's metadata names it)."""

    timeout: float = _var("FXPAR_TIMEOUT", 300.0, _number(float, 0, True), "seconds > 0",
                          "fxpar.launch, fxpar.api")
    """Seconds a rank waits for a peer (the process group's collectives, pipeline receives, barriers)."""
    heartbeat: float = _var("FXPAR_HEARTBEAT", 0.5, _number(float, 0, False), "seconds >= 0 (0: off)",
                            "fxpar.runtime.liveness")
    """Seconds between a rank's heartbeats in the rendezvous store; 0 turns the heartbeat off."""
    max_programs: int = _var("FXPAR_MAX_PROGRAMS", 8, _number(int, 1, False), "an integer >= 1",
                             "fxpar.runtime.programs")
    """Programs (input signatures) a compiled model keeps in its LRU cache."""
    check_collectives: bool = _var("FXPAR_CHECK_COLLECTIVES", False, _switch, _SWITCH,
                                   "fxpar.runtime.collectives")
    """Compare every collective's shapes across the group before running it (debugging)."""
    compile_fallback: bool = _var("FXPAR_COMPILE_FALLBACK", True, _switch, _SWITCH, "fxpar.runtime.compile")
    """A stage Inductor cannot compile runs eagerly with a warning; off: the compile error is raised."""
    compile_backend: str = _var("FXPAR_COMPILE_BACKEND", "inductor", _one_of("inductor", "aot_eager"),
                                "inductor or aot_eager", "fxpar.runtime.compile")
    """What compiles a stage: Inductor, or ``aot_eager`` (Dynamo's capture and AOT autograd's partition run
    eagerly, fxpar's collectives left opaque: the capture checked in seconds, for bisecting and dry runs)."""
    trim_step: bool = _var("FXPAR_TRIM_STEP", False, _switch, _SWITCH, "fxpar.runtime.train_step")
    """Each training step gives the C heap's freed pages back (``malloc_trim``) once they pass 64 MiB: a
    lower resident size between steps, for the first touch of those pages again in the next step."""
    profile: str | None = _var("FXPAR_PROFILE", None, str, "a profile name or a `fxpar calibrate` JSON path",
                               "fxpar.cost.profiles, fxpar.planner.auto")
    """The device profile the CPU is priced on (None: ``~/.cache/fxpar/profile.json``, else ``cpu``)."""
    disabled_passes: frozenset[str] = _var("FXPAR_DISABLE_PASSES", frozenset(), _names,
                                           "pass names separated by commas", "fxpar.passes.runner")
    """Passes the runner skips, by name (for bisecting a miscompile)."""
    dump_dir: Path | None = _var("FXPAR_DUMP_DIR", None, Path, "a directory", "fxpar.passes.runner")
    """Where the runner writes each graph before and after each pass (None: nowhere)."""
    traceback: bool = _var("FXPAR_TRACEBACK", False, _switch, _SWITCH, "fxpar.cli.failures")
    """Keep full tracebacks: user errors carry theirs, ``fxpar launch`` shows torchrun's report."""
    kernels_triton: bool | None = _var("FXPAR_KERNELS_TRITON", None, _tristate,
                                       "1 (Triton everywhere) or 0 (torch everywhere)",
                                       "fxpar.runtime.kernels")
    """The kernels' path: True Triton on every device, False torch's; None: each kernel's own rule."""
    program_cache: Path | None = _var("FXPAR_PROGRAM_CACHE", None, _cache_dir,
                                      "1/on (~/.cache/fxpar/programs), 0/off, or a directory",
                                      "fxpar.frontend.capture")
    """Where traced programs are kept across runs (None: nowhere; every run traces)."""
    launcher: bool = _var("FXPAR_LAUNCHER", False, _switch, _SWITCH, "fxpar.cli.failures")
    """Set by ``fxpar launch`` for its workers (the launcher prints their failures); not for users."""

    @staticmethod
    def variables() -> dict[str, str]:
        """Variable name -> field name, in field order."""
        return {f.metadata["env"]: f.name for f in fields(RunOptions)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RunOptions:
        """The options ``environ`` sets (unset or empty: the default). A value outside what a variable
        accepts raises :class:`OptionError` naming the variable, the value and what it accepts."""
        values = {}
        for f in fields(cls):
            name = f.metadata["env"]
            raw = environ.get(name)
            if raw is None or not raw.strip():
                continue
            try:
                values[f.name] = f.metadata["parse"](raw.strip())
            except ValueError:
                raise OptionError(f"{name}={raw!r} is not accepted: use {f.metadata['accepts']} "
                                  f"(unset or empty: {_shown(f.default)})", variable=name, value=raw) from None
        return cls(**values)


def _shown(default) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float):
        return f"{default:g}"
    return "none" if default is None or default == frozenset() else str(default)


_NAMES = tuple(RunOptions.variables())
_KEYS = tuple(map(os.fsencode, _NAMES))


@functools.lru_cache(maxsize=8)
def _parsed(raw: tuple[str | bytes | None, ...]) -> RunOptions:
    return RunOptions.from_env({k: os.fsdecode(v) for k, v in zip(_NAMES, raw) if v is not None})


def run_options() -> RunOptions:
    """This process's options: the current environment's ``FXPAR_*`` values, parsed once per distinct set of
    values (a bad one raises :class:`OptionError` at every call)."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        # os.environ's own dict (bytes on POSIX, kept in step by os.environ's writes, monkeypatch's too):
        # 0.5 us against 11 us for os.environ.get's encode/decode per name, and the collectives ask per call
        return _parsed(tuple(map(data.get, _KEYS)))
    return _parsed(tuple(map(os.environ.get, _NAMES)))


def kernels_triton() -> bool | None:
    """``FXPAR_KERNELS_TRITON``: True (the Triton path on every device), False (torch's everywhere), None
    (unset: each kernel's own rule). For :mod:`fxpar.runtime.kernels`."""
    return run_options().kernels_triton
