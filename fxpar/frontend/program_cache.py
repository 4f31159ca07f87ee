"""Captured programs kept on disk across runs (``FXPAR_PROGRAM_CACHE``), so an unchanged model is not traced
again: :func:`key` names what a capture depends on, :func:`load` and :func:`save` read and write the
``ExportedProgram`` with ``torch.export.load`` / ``torch.export.save``.

Reads: the model (its class, config, every submodule's class, training flag and plain attributes, the source
files those classes come from, every parameter's and buffer's name, shape, dtype and device), the example
inputs (pytree structure, tensor shapes, dtypes, devices; other values by repr), the capture options, and
the torch, transformers and fxpar versions with fxpar's frontend sources. Writes: ``<dir>/<key>.pt2``.

Only the export frontend's programs are kept, and only with static shapes or ``dynamic=True`` (a
``dynamic_shapes`` dict holds ``Dim`` objects without a stable text). The weights are not written: the
saved program's state dict holds meta tensors of the same shapes (lowering binds the model's own tensors).
A file that does not load (another torch, a damaged write) is traced again and rewritten; a program that
``torch.export.save`` cannot write (an operator it does not serialise) is used as traced and not kept.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

FORMAT = 1  # bumped when what a file holds changes
_PLAIN = (bool, int, float, str, type(None))
_FRONTEND_DIR = Path(__file__).parent


def cacheable(frontend: str, dynamic) -> bool:
    """Whether a capture with these options may be kept (the export frontend, bool ``dynamic``)."""
    return frontend in ("auto", "export") and isinstance(dynamic, bool)


def key(model: torch.nn.Module, example_args: tuple, example_kwargs: dict, *, frontend: str, dynamic: bool,
        stack_traces: bool) -> str:
    """The hex digest naming the program ``model`` captures from these inputs and options."""
    parts = {
        "format": FORMAT,
        "versions": [torch.__version__, _version("transformers"), _version("fxpar"),
                     _sources_digest(tuple(sorted(str(p) for p in _FRONTEND_DIR.glob("*.py"))))],
        "options": [frontend, dynamic, stack_traces],
        "config": _config_text(model),
        "modules": [[name, _class_name(type(m)), m.training, _plain_attributes(m)]
                    for name, m in model.named_modules(remove_duplicate=False)],
        "sources": _sources_digest(tuple(sorted({_source_file(type(m)) for m in model.modules()} - {""}))),
        "tensors": [[name, list(t.shape), str(t.dtype), t.device.type, bool(t.requires_grad)]
                    for name, t in [*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)]],
        "inputs": _inputs(example_args, example_kwargs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def load(directory: Path, name: str) -> torch.export.ExportedProgram | None:
    """The program saved under ``name``, or None (none saved, or it does not load)."""
    path = directory / f"{name}.pt2"
    if not path.is_file():
        return None
    try:
        return torch.export.load(path)
    except Exception as exc:  # another torch's file, or a damaged one: traced again and rewritten
        log.info("fxpar: the cached program %s does not load (%s: %s); tracing again", path,
                 type(exc).__name__, exc)
        return None


def save(directory: Path, name: str, ep: torch.export.ExportedProgram) -> bool:
    """Write ``ep`` under ``name`` without its weights (meta tensors in their place); False where
    ``torch.export.save`` cannot write it. The file appears whole or not at all (written, then renamed)."""
    light = copy.copy(ep)
    light._state_dict = {k: _meta_like(v) for k, v in ep.state_dict.items()}
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp.pt2")
    os.close(fd)
    try:
        torch.export.save(light, tmp)
        os.replace(tmp, directory / f"{name}.pt2")
        return True
    except Exception as exc:  # an operator or input torch.export cannot serialise: used as traced, not kept
        log.info("fxpar: the traced program is not cached: torch.export.save failed (%s: %s)",
                 type(exc).__name__, exc)
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = t.detach().to("meta")
    return torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta


def _inputs(example_args: tuple, example_kwargs: dict) -> list:
    leaves, spec = pytree.tree_flatten((tuple(example_args), dict(example_kwargs)))
    described = [[list(v.shape), str(v.dtype), v.device.type, bool(v.requires_grad)]
                 if isinstance(v, torch.Tensor) else repr(v) for v in leaves]
    return [str(spec), described]


def _config_text(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json(use_diff=False) if callable(to_json) else None


def _plain_attributes(m: torch.nn.Module) -> list:
    """A module's public attributes of plain types (``head_dim``, ``eps``, ``scaling``): forward may read them."""
    return sorted([k, repr(v)] for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN))


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _source_file(cls: type) -> str:
    try:
        return inspect.getsourcefile(cls) or ""
    except TypeError:  # a builtin class
        return ""


def _sources_digest(paths: tuple[str, ...]) -> str:
    """One digest over the files' contents (each read once per size and modification time)."""
    h = hashlib.sha256()
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        h.update(p.encode())
        h.update(_file_digest(p, st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=512)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
