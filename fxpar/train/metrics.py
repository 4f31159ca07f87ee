"""What a fine-tuning run reports: one JSON object per line per step (and per evaluation), TensorBoard
scalars when ``torch.utils.tensorboard`` can be imported, and the numbers behind them.

* **Memory per rank**: each rank's measured bytes of parameters, gradients and optimizer states
  (``CompiledModel.memory()``), gathered into one list (one small all-gather per logged step).
* **MFU**: model FLOPs of one training step from the cost model (``fxpar.cost`` annotations of the
  traced program: every node's forward and backward FLOPs for the traced batch, i.e. the whole model,
  before any parallelisation, recomputation excluded as in the PaLM definition) divided by the step time
  and by ``world x`` the peak FLOP/s of the device's profile (:func:`fxpar.cost.profiles.profile_for_device`:
  a GPU's published dense peak in the dtype the step computes in; a CPU host's calibrated or rough
  sustained rate, having no published peak), as the planner's predicted MFU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from fxpar.cost.profiles import DeviceProfile, profile_for_device
from fxpar.ir import meta
from fxpar.runtime import dist_calls


def step_flops(program) -> int:
    """Forward + backward FLOPs of one training step on the batch ``program`` was traced for."""
    total = 0
    for node in program.graph.nodes:
        cost = node.meta.get(meta.COST)
        if cost is not None:
            total += cost.flops + cost.bwd_flops
    return total


def device_profile(device: torch.device) -> DeviceProfile:
    """The profile of the device the ranks compute on (its MFU denominator)."""
    return profile_for_device(device)


def mfu(flops: float, seconds: float, world: int, profile: DeviceProfile, dtype: str = "fp32") -> float:
    """Model FLOPs utilisation of a step of ``flops`` that took ``seconds`` on ``world`` devices of
    ``profile`` computing in ``dtype``: against the profile's peak (:meth:`DeviceProfile.peak`)."""
    return flops / max(seconds, 1e-12) / (world * profile.peak(dtype))


def memory_per_rank(compiled) -> list[float]:
    """Each rank's measured MiB (parameters + gradients + optimizer states), the same list on every rank."""
    mine = torch.tensor([sum(compiled.memory().get("measured", {}).values()) / 2**20], dtype=torch.float64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine.item()]
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist_calls.all_gather_list(out, mine)
    return [t.item() for t in out]


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


class MetricsLog:
    """Rank 0 writes each record as one JSON line to ``path`` and, with ``tensorboard`` a directory and
    the package installed, as TensorBoard scalars; other ranks write nothing."""

    def __init__(self, path: str | Path | None, tensorboard: str | Path | None, rank: int):
        self.rank = rank
        self.file = None
        self.writer = None
        if rank != 0:
            return
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # an optional dependency: say so once, keep the JSON lines
                print(f"fxpar train: --tensorboard {tensorboard}: the tensorboard package is not installed "
                      "(pip install tensorboard); metrics go to the JSON lines only", flush=True)
            else:
                self.writer = SummaryWriter(str(tensorboard))

    def write(self, record: dict) -> None:
        if self.rank != 0:
            return
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.writer is not None:
            prefix = "eval/" if any(k.startswith("eval_") for k in record) else "train/"
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.writer.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.writer is not None:
            self.writer.close()
