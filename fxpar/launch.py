"""Accelerator selection and process-group set-up under ``torchrun``.

``LOCAL_RANK`` picks the device: ``cuda:<LOCAL_RANK mod visible devices>`` when CUDA is available,
else the CPU. CUDA itself applies ``CUDA_VISIBLE_DEVICES`` (which devices exist for this process, in
the order given) and ``CUDA_DEVICE_ORDER`` (``PCI_BUS_ID`` numbers devices as ``nvidia-smi`` does;
the default ``FASTEST_FIRST`` may not): fxpar never renumbers devices, so both are honoured as set.
The backend follows the device: NCCL on CUDA, gloo on the CPU. Every collective gets the timeout
(``FXPAR_TIMEOUT`` seconds, default 300), so a dead rank makes the others fail instead of hang.

NCCL troubleshooting (see docs/launch.md): ``NCCL_DEBUG=INFO`` shows the transport NCCL picked;
``NCCL_P2P_DISABLE=1`` when GPUs cannot reach each other directly (some PCIe topologies and VMs hang
or corrupt in P2P); ``NCCL_IB_DISABLE=1`` without InfiniBand; ``NCCL_SOCKET_IFNAME=eth0`` to choose the
network interface; ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` so a failed collective aborts the job.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def device_for_rank(local_rank: int | None = None) -> torch.device:
    """The device this process should use: ``cuda:<local_rank mod device count>`` or ``cpu``."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(timeout: float | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (a no-op for a single process without torchrun).
    Returns ``(rank, world size, device)``."""
    device = device_for_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size(), device) if dist.is_initialized() else (0, 1, device)
    seconds = float(timeout if timeout is not None else os.environ.get("FXPAR_TIMEOUT", 300))
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=seconds),
                            device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device
