"""Accelerator selection and process-group set-up under ``torchrun``.

``LOCAL_RANK`` picks the device: ``cuda:<LOCAL_RANK mod visible devices>`` when CUDA is available,
else the CPU. CUDA itself applies ``CUDA_VISIBLE_DEVICES`` (which devices exist for this process, in
the order given) and ``CUDA_DEVICE_ORDER`` (``PCI_BUS_ID`` numbers devices as ``nvidia-smi`` does;
the default ``FASTEST_FIRST`` may not): fxpar never renumbers devices, so both are honoured as set.
The backend follows the device: NCCL on CUDA, gloo on the CPU. Every collective gets the timeout
(``FXPAR_TIMEOUT`` seconds, default 300), so a dead rank makes the others fail instead of hang, and
each rank beats a heartbeat in the rendezvous store so that the failure names the rank that died.
``fxpar.compile`` calls :func:`init_distributed` itself when torchrun launched the process and no
process group exists yet.

NCCL troubleshooting (see docs/launch.md): ``NCCL_DEBUG=INFO`` shows the transport NCCL picked;
``NCCL_P2P_DISABLE=1`` when GPUs cannot reach each other directly (some PCIe topologies and VMs hang
or corrupt in P2P); ``NCCL_IB_DISABLE=1`` without InfiniBand; ``NCCL_SOCKET_IFNAME=eth0`` to choose the
network interface; ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` so a failed collective aborts the job.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os

import torch
import torch.distributed as dist

from fxpar.ir.errors import PlanError
from fxpar.ir.options import run_options
from fxpar.ir.plan import Plan
from fxpar.planner.auto import plan_key, plan_mismatch
from fxpar.runtime import dist_calls


def device_for_rank(local_rank: int | None = None) -> torch.device:
    """The device this process should use: ``cuda:<local_rank mod device count>`` or ``cpu``."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def device_for_model(model: torch.nn.Module) -> torch.device:
    """Where ``fxpar.compile(device=None)`` runs ``model``: where its weights already are, or, for a model
    on the meta device (its shards are made on this rank), :func:`device_for_rank`."""
    real = {p.device for p in model.parameters() if not p.is_meta}
    return real.pop() if len(real) == 1 else device_for_rank()


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors (with gloo for CPU tensors beside it), gloo on the CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """True when the environment describes a world of several ranks (torchrun, or a launcher that sets
    what torchrun sets: ``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def check_launch_world(plan) -> None:
    """A plan the launch's world (torchrun's ``WORLD_SIZE``) does not fit, refused before this rank joins the
    process group: a rank that fails later leaves its peers a half-formed group (gloo's 'connectFullMesh
    failed' on the terminal)."""
    from fxpar.planner.feasibility import check_world

    if plan is not None and os.environ.get("WORLD_SIZE") and not dist.is_initialized():
        check_world(plan, int(os.environ["WORLD_SIZE"]))


def _attempt_store(seconds: float) -> dict:
    """Under torchrun's agent store: the store, rank and world for ``init_process_group``, with the keys of
    this attempt under their own prefix. torchrun (2.13) keeps one store for every restart of the group and
    the default group's keys carry no attempt number, so after ``--max-restarts`` restarted the workers, a
    rank that reads a peer's address before the peer wrote it again gets the dead process's address from
    the attempt before and hangs in gloo's or NCCL's connect. Elsewhere: {} (the ``env://`` default)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=seconds))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"fxpar/attempt_{attempt}", store), "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"])}


def init_distributed(timeout: float | None = None) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (a no-op for a single process without torchrun, and
    where a group exists already), and start this rank's heartbeat (:mod:`fxpar.runtime.liveness`), so
    that a peer that dies is named. ``timeout``: seconds a rank waits for a peer (None: ``FXPAR_TIMEOUT``,
    :class:`fxpar.ir.options.RunOptions`). Returns ``(rank, world size, device)``."""
    from fxpar.runtime import liveness

    device = device_for_rank()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        if not dist.is_initialized():
            return 0, 1, device
        liveness.start()
        return dist.get_rank(), dist.get_world_size(), device
    seconds = float(timeout) if timeout is not None else run_options().timeout
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=seconds),
                            device_id=device if device.type == "cuda" else None, **_attempt_store(seconds))
    atexit.register(_leave)  # the group fxpar made, fxpar takes down: a script need not know it exists
    liveness.start()  # registered after _leave, so its own exit hook (stopping the heartbeat) runs first
    return dist.get_rank(), dist.get_world_size(), device


def _leave() -> None:
    """At exit, destroy the process group ``init_distributed`` created, and its subgroups, while the
    interpreter is whole: left to the interpreter's teardown, gloo's threads can abort the process after
    a run that succeeded. A group's threads stop when its last reference goes, so fxpar's own references
    go too (its group table, and the compiled programs the garbage collector can now free); a compiled
    model a script still holds in a global keeps its groups to the end."""
    from fxpar.runtime import groups, liveness

    liveness.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    groups.release_process_groups()
    gc.collect()


def world_size() -> int:
    """The world ``compile`` runs in: the process group's, or before one exists the one torchrun describes
    (``WORLD_SIZE``; ``compile`` joins that group after planning), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_same_plan(plan: Plan, world: int) -> None:
    """Every rank must have chosen the same plan: compared over the default process group (one small
    all-gather) once it exists; a PlanError naming the differing plans otherwise."""
    if world == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    keys = dist_calls.all_gather_object(plan_key(plan))
    message = plan_mismatch(keys)
    if message:
        raise PlanError(message)
