"""Checkpoints of a compiled model: each rank saves its own shards; any other plan loads them.

Layout of ``<dir>/step_<N>/``: a torch.distributed.checkpoint (DCP) directory and ``fxpar.json``.

* ``model.<fqn>``: every tensor of the model under its original (Hugging Face) FQN and full shape, saved
  as the boxes the ranks hold (``fxpar.runtime.state.local_state``): a TP shard (each fused piece apart), a
  ZeRO-3 rank's slice of a flat bucket cut back into boxes of each parameter. Each entry has one writer
  (one dp replica, one TP rank of what TP does not cut, the owning pipeline rank of a tied weight), and
  nothing is gathered: a rank holds its shards plus one chunk being serialised
  (``tests/api/test_checkpoint.py`` measures it). Tied weights are saved once, aliases in ``fxpar.json``.
* ``optim.<fqn>.<state>``: the optimizer's states (``exp_avg``, ``exp_avg_sq``, ``step``, ...) the same
  way, ZeRO-1/2/3 flat shards included, so :func:`load_optimizer` resumes exactly under any plan. What
  holds: optimizers whose state is per parameter entry (the ones ZeRO accepts), with one ``param_groups``
  layout (hyperparameters restored from rank 0's groups). Under bf16 with ZeRO-1/2 the fp32 master
  shards are not saved: they are rebuilt from the (bf16) parameters.
* ``fxpar.json``: step, plan, world size, tied aliases, the optimizer's hyperparameters.

Loading: ``compile(meta_model, plan, weights=checkpoint.model_source(path))`` (or ``weights=path``) reads
only the boxes each rank's TP shard needs; DCP's resharding maps saved chunks to requested ones, so the
saving and loading plans are independent. :func:`load_model_state` still returns full tensors.

A save goes to ``step_<N>.partial`` and is renamed to ``step_<N>`` only after every rank has finished
writing; ``<dir>/latest`` (replaced atomically) names the last complete one. A process killed during a
save leaves ``latest`` and the checkpoint it names untouched; a write the operating system refuses (no
space, no permission, a read-only file system) is one :class:`CheckpointError` on every rank naming the
file and the reason, ``latest`` untouched too (what a run resumes from, how many it keeps: ``fxpar.train.saving``).

:func:`export_hf` streams the model into ``save_pretrained``'s safetensors layout, one tensor at a time.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from fxpar.ir.errors import CheckpointError, PlanError
from fxpar.runtime import dist_calls
from fxpar.runtime.liveness import guard
from fxpar.runtime.state import Held, local_state
from fxpar.safetensors_writer import SafetensorsWriter
from fxpar.weights import CheckpointReader

FORMAT = 2  # 1: full tensors and optim.rank<r>.pt files (still read)


def _barrier() -> None:
    if dist.is_initialized():
        with guard("a checkpoint barrier"):  # a peer that died is named, within the group's timeout
            dist_calls.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ---- DCP glue: chunks as write and read items ------------------------------------------------------

class _ChunkSavePlanner(DefaultSavePlanner):
    """Writes each :class:`Held` chunk as one DCP shard of its full tensor; DCP's global plan checks
    that the chunks of every rank tile each tensor exactly (no overlap, nothing missing)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items, self.views = [], {}
        for key, held in self.state_dict.items():
            for offsets, view in held.chunks:
                self.views[(key, tuple(offsets))] = view
                chunk = ChunkStorageMetadata(torch.Size(offsets), view.shape)
                items.append(WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk, TensorProperties(dtype=held.dtype), torch.Size(held.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, item: WriteItem) -> torch.Tensor:
        return self.views[(item.index.fqn, tuple(item.index.offset))]


class _StreamingWriter(dcp.FileSystemWriter):
    """DCP's file writer, one chunk in memory at a time. DCP's own ``write_data`` keeps every tensor of a
    file referenced until the file is closed (and copies each view first), so a rank whose chunks are views
    of flat ZeRO shards would hold a second copy of all of them; here each chunk is copied (only when it
    is a view), written with ``torch.save`` as DCP does, and dropped. FileSystemReader reads the result."""

    def write_data(self, plan: SavePlan, planner) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        path, results = Path(self.path) / name, []
        try:
            with open(path, "wb") as f:
                for item in plan.items:
                    data = planner.resolve_data(item).detach().cpu()
                    if data.untyped_storage().nbytes() != data.nbytes:  # a view: torch.save would write its base
                        data = data.clone(memory_format=torch.contiguous_format)
                    start = f.tell()
                    torch.save(data, f)
                    del data
                    size = f.tell() - start
                    results.append(WriteResult(item.index, size, _StorageInfo(name, start, size)))
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:
            # torch.save reports a refused write as "unexpected pos" with the OSError only as its context,
            # which DCP's gather of failures drops: the OSError itself travels, with the file's name
            cause = _os_error(e)
            if cause is None:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename or str(path)) from e
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done


# ---- saving and loading ----------------------------------------------------------------------------

def save(compiled, directory: str | Path, step: int, extra: dict | None = None) -> Path:
    """Save this rank's shards of the model and the optimizer at ``step`` under ``directory/step_<N>``;
    every rank calls it. Nothing is gathered. ``extra``: JSON-able state of the training loop (the
    learning-rate schedule, the data position), the same on every rank; ``info(path)["extra"]``.
    Returns the checkpoint's path. A write the OS refuses is a :class:`CheckpointError` (on every rank where
    DCP writes failed, since DCP gathers its failures); the partial save is removed, ``latest`` untouched."""
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    partial = directory / f"step_{step:08d}.partial"
    try:
        return _save(compiled, directory, step, extra, final, partial)
    except (OSError, CheckpointException) as e:
        failure = _failure(e)
        if failure is None:
            raise
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a full disk needs back
        raise _write_error(directory, final, *failure) from None


def _save(compiled, directory: Path, step: int, extra: dict | None, final: Path, partial: Path) -> Path:
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier interrupted save
        partial.mkdir()
    _barrier()
    held = local_state(compiled, optimizer=compiled.optimizer is not None)
    with warnings.catch_warnings():  # on one process DCP warns that it saves without a process group
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(held, storage_writer=_StreamingWriter(str(partial)), planner=_ChunkSavePlanner())
    _barrier()
    if _rank() == 0:
        program = compiled.program
        meta = {"format": FORMAT, "step": step, "plan": compiled.plan.to_dict(), "world": compiled.world,
                "aliases": {a: p.fqn for p in program.params.values() for a in p.fqns if a != p.fqn},
                "param_groups": _groups(compiled.optimizer), "extra": extra or {}}
        (partial / "fxpar.json").write_text(json.dumps(meta, default=str))
        if final.exists():
            trash = directory / f"step_{step:08d}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(partial, final)
        tmp = directory / "latest.tmp"
        tmp.write_text(final.name + "\n")
        os.replace(tmp, directory / "latest")
    _barrier()
    return final


def _os_error(error: BaseException | None) -> OSError | None:
    """The file system's OSError behind ``error`` (itself, or along its causes and contexts), or None."""
    for _ in range(8):
        if isinstance(error, (ConnectionError, TimeoutError)):  # a peer, not the disk
            return None
        if error is None or isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def _failure(error: BaseException) -> tuple[int, OSError] | None:
    """(rank, OSError) of a failed save: the lowest rank whose write the OS refused, or None."""
    if isinstance(error, CheckpointException):
        for rank in sorted(error.failures):
            cause = _os_error(error.failures[rank][0])
            if cause is not None:
                return rank, cause
        return None
    return None if _os_error(error) is None else (_rank(), _os_error(error))


_FIX = {errno.ENOSPC: "free space on that file system or save to another one",
        errno.EDQUOT: "free space within the quota or save elsewhere",
        errno.EACCES: "save to a directory this user may write to", errno.EPERM: "save where this user may write",
        errno.EROFS: "save to a directory on a writable file system"}


def _write_error(directory: Path, final: Path, rank: int, error: OSError) -> CheckpointError:
    reason = error.strerror or str(error)
    where = error.filename or directory
    try:
        kept = latest(directory)
    except OSError:  # the directory cannot be read either
        kept = None
    return CheckpointError(
        f"checkpoint {final} was not written: {reason} (rank {rank} writing {where}); "
        + (f"{directory / 'latest'} still names the complete {kept.name}" if kept else
           f"no complete checkpoint in {directory} yet")
        + f"; fix: {_FIX.get(error.errno, 'check that file system')}", path=where, reason=reason)


_STEP = re.compile(r"step_(\d+)")


def checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints under ``directory`` (``step_<N>`` holding ``fxpar.json``), oldest step first."""
    directory = Path(directory)
    found = [p for p in directory.iterdir() if _STEP.fullmatch(p.name) and (p / "fxpar.json").is_file()] \
        if directory.is_dir() else []
    return sorted(found, key=lambda p: int(_STEP.fullmatch(p.name)[1]))


def latest(directory: str | Path) -> Path | None:
    """The last complete checkpoint under ``directory`` (None if there is none)."""
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    path = Path(directory) / marker.read_text().strip()
    return path if (path / "fxpar.json").is_file() else None


def info(path: str | Path) -> dict:
    """``fxpar.json`` of a checkpoint: ``step``, ``plan``, ``world`` (and, from format 2, ``aliases``)."""
    return json.loads((Path(path) / "fxpar.json").read_text())


def model_source(path: str | Path) -> CheckpointReader:
    """A checkpoint (a ``step_<N>`` directory, or the directory ``save`` wrote into: its latest) as
    ``compile(..., weights=...)``: each rank reads only the chunks of its own TP shards."""
    return CheckpointReader(path)


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full tensors by original FQN, tied aliases included (every rank that calls it reads
    them all: prefer ``weights=model_source(path)``, which reads only a rank's shards)."""
    ckpt = CheckpointReader(path)
    held = {}
    for key in ckpt.keys("model."):
        md = ckpt.metadata.state_dict_metadata[key]
        t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        held[key] = Held(tuple(md.size), t.dtype, [((0,) * t.dim(), t)])
    ckpt.read(held)
    state = {k[len("model."):]: h.chunks[0][1] for k, h in held.items()}
    state.update({a: state[c] for a, c in ckpt.aliases.items() if c in state})
    return state


def load_optimizer(compiled, path: str | Path) -> None:
    """Restore the optimizer state saved at ``path`` into ``compiled``'s optimizer on this rank, under any
    plan: each rank reads its own parameters' (or ZeRO shards') parts of every state by FQN. The states
    are bitwise those saved, so training resumes as if uninterrupted (up to the new plan's own rounding)."""
    ckpt = CheckpointReader(path)
    opt = compiled.optimizer
    if not ckpt.keys("optim."):  # saved before any step (nothing to restore), or by format 1
        return _load_rank_files(compiled, ckpt) if (ckpt.path / f"optim.rank{_rank()}.pt").is_file() else None
    if opt is None:
        return
    _init_optimizer_state(opt)
    ckpt.read(local_state(compiled, optimizer=True, writers_only=False))
    groups = ckpt.info.get("param_groups") or []
    if groups and len(groups) != len(opt.param_groups):
        raise PlanError(f"optimizer state in {ckpt.path} has {len(groups)} parameter groups, this optimizer "
                        f"{len(opt.param_groups)}: build the optimizer with the same groups")
    for group, saved in zip(opt.param_groups, groups):
        for k, v in saved.items():
            if k not in group or k == "params":
                continue
            if isinstance(group[k], torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = type(group[k])(v) if isinstance(group[k], (tuple, float, int)) else v


def _load_rank_files(compiled, ckpt: CheckpointReader) -> None:
    """Format 1: ``optim.rank<r>.pt``, resumable under the same plan only."""
    saved = ckpt.info
    if saved["plan"] != compiled.plan.to_dict() or saved["world"] != compiled.world:
        raise PlanError(f"optimizer state in {ckpt.path} was saved under plan {saved['plan']} on {saved['world']} "
                        "ranks by an older fxpar; it resumes only under that plan (the weights load under any)")
    compiled.optimizer.load_state_dict(torch.load(ckpt.path / f"optim.rank{_rank()}.pt", weights_only=True))


def _groups(opt) -> list[dict]:
    """The optimizer's hyperparameters per group (numbers, flags, tuples), JSON-ready."""
    if opt is None:
        return []
    keep = (bool, int, float, str, tuple, list, type(None))
    return [{k: (v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v) for k, v in g.items()
             if k != "params" and (isinstance(v, keep) or isinstance(v, torch.Tensor) and v.dim() == 0)}
            for g in opt.param_groups]


def _init_optimizer_state(opt) -> None:
    """Create the optimizer's per-parameter states (torch makes them at the first step) so that a load has
    tensors to fill: one step with zero gradients and a learning rate of 0, which leaves the parameters as
    they are; the states it makes are overwritten by the load."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if all(p in opt.state for p in params):
        return
    lrs = [g["lr"] for g in opt.param_groups]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad


# ---- Hugging Face export ---------------------------------------------------------------------------

def export_hf(compiled, directory: str | Path, max_shard_size: int | str = "5GB") -> Path:
    """Write ``config.json`` and the model in ``save_pretrained``'s safetensors layout (``model.safetensors``,
    or ``model-0000i-of-0000N.safetensors`` files and ``model.safetensors.index.json`` when it passes
    ``max_shard_size``), which ``from_pretrained`` loads. Every rank calls it; tensors are gathered on rank
    0 one at a time, each from the ranks that write it in a checkpoint, and written at once, so no rank
    holds more than its shards and one full tensor. Tied weights are written once (transformers ties
    them again)."""
    directory, program = Path(directory), compiled.program
    if program.info.wrapper_prefix:  # PEFT's names are not save_pretrained's layout
        raise PlanError(f"fxpar.checkpoint.export_hf: {program.info.model_class} is wrapped (PEFT, under "
                        f"{program.info.wrapper_prefix!r}): export it with fxpar.adapters.export_adapter")
    held = local_state(compiled)
    mine = [(k[len("model."):], h.shape, h.dtype, [(o, tuple(v.shape)) for o, v in h.chunks]) for k, h in held.items()]
    if dist.is_initialized() and compiled.world > 1:
        every = dist_calls.gather_object(mine, dst=0)
    else:
        every = [mine]
    order, seen = [], {a for group in program.tied_groups() for a in group[1:]}  # tied: the first name only
    for name in compiled.model.state_dict(keep_vars=True):
        if name not in seen and _canonical(program, name) not in seen:
            seen.add(_canonical(program, name))
            order.append(name)
    writer = SafetensorsWriter(directory, max_shard_size) if _rank() == 0 else None
    if writer is not None:
        pieces = {}  # canonical FQN -> [(rank, offsets, sizes)]
        for r, items in enumerate(every):
            for fqn, shape, dtype, chunks in items:
                pieces.setdefault(fqn, [shape, dtype, []])[2] += [(r, o, z) for o, z in chunks]
        writer.begin(compiled.model.config, [(n, *pieces[_canonical(program, n)][:2]) for n in order
                                             if _canonical(program, n) in pieces])
    for name in order:
        fqn = _canonical(program, name)
        if writer is not None:
            if fqn not in pieces:
                continue
            shape, dtype, chunks = pieces[fqn]
            full = torch.empty(shape, dtype=dtype, device=compiled.device)
            local = dict(held.get("model." + fqn, Held((), dtype)).chunks)
            for r, o, z in chunks:
                box = full[tuple(slice(a, a + n) for a, n in zip(o, z))]
                if r == 0:
                    box.copy_(local[o])
                else:
                    buf = torch.empty(z, dtype=dtype, device=compiled.device)
                    dist_calls.recv(buf, r)
                    box.copy_(buf)
            writer.write(name, full.cpu())
            del full
        elif "model." + fqn in held:
            for _, view in held["model." + fqn].chunks:
                dist_calls.send(view.contiguous(), 0)
    _barrier()
    return directory


def _canonical(program, name: str) -> str:
    try:
        return program.canonical(name)
    except KeyError:
        return name
