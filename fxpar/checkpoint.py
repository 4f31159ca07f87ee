"""Checkpoints of a compiled model: save under one plan, load under another.

Layout of ``<dir>/step_<N>/`` (torch.distributed.checkpoint for the model, one file per rank for the
optimizer):

* the model's tensors under their original (Hugging Face) FQNs, full, through DCP: any plan can read
  them and cut its own shards (``compile(..., weights=load_model_state(...))``);
* ``optim.rank<r>.pt``: rank r's optimizer state as its optimizer holds it (shards under ZeRO), for
  resuming under the same plan (``torch.load(weights_only=True)``: tensors and plain containers only);
* ``fxpar.json``: the step, the plan and the world size.

A save goes to ``step_<N>.partial`` and is renamed to ``step_<N>`` only after every rank has finished
writing; ``<dir>/latest`` (replaced atomically) names the last complete one. A process killed during a
save leaves ``latest`` and the checkpoint it names untouched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fxpar.ir.errors import PlanError


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(compiled, directory: str | Path, step: int) -> Path:
    """Save model (full tensors, original FQNs) and optimizer (per rank) at ``step``; every rank calls it."""
    directory = Path(directory)
    final = directory / f"step_{step:08d}"
    partial = directory / f"step_{step:08d}.partial"
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier interrupted save
        partial.mkdir()
    _barrier()
    state = compiled.full_state_dict()
    dcp.save({"model": state}, checkpoint_id=str(partial))
    if compiled.optimizer is not None:
        torch.save(compiled.optimizer.state_dict(), partial / f"optim.rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (partial / "fxpar.json").write_text(json.dumps({"step": step, "plan": compiled.plan.to_dict(),
                                                        "world": compiled.world}, default=str))
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


def latest(directory: str | Path) -> Path | None:
    """The last complete checkpoint under ``directory`` (None if there is none)."""
    marker = Path(directory) / "latest"
    if not marker.is_file():
        return None
    path = Path(directory) / marker.read_text().strip()
    return path if (path / "fxpar.json").is_file() else None


def info(path: str | Path) -> dict:
    return json.loads((Path(path) / "fxpar.json").read_text())


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The model's full tensors by original FQN (every rank reads them; pass them as ``weights=``)."""
    path = Path(path)
    if not (path / "fxpar.json").is_file():
        raise PlanError(f"{path} is not a complete fxpar checkpoint (no fxpar.json); use checkpoint.latest(dir)")
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    state = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            state[key[len("model."):]] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load({"model": state}, checkpoint_id=str(path))
    return state


def load_optimizer(compiled, path: str | Path) -> None:
    """Restore this rank's optimizer state (same plan as at save time)."""
    saved = info(path)
    if saved["plan"] != compiled.plan.to_dict() or saved["world"] != compiled.world:
        raise PlanError(f"optimizer state in {path} was saved under plan {saved['plan']} on {saved['world']} ranks; "
                        f"it resumes only under the same plan (the model weights load under any plan)")
    state = torch.load(Path(path) / f"optim.rank{_rank()}.pt", weights_only=True)
    compiled.optimizer.load_state_dict(state)


def export_hf(compiled, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``from_pretrained`` loads (every rank calls)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    state = compiled.full_state_dict()
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        compiled.model.config.save_pretrained(directory)
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        program = compiled.program
        for group in program.tied_groups():  # one copy per tied group: transformers ties them again
            for alias in group[1:]:
                tensors.pop(alias, None)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _barrier()
    return directory
