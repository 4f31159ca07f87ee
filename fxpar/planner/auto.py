"""The planner's entry points: ``fxpar.autoplan``, ``fxpar.price`` and what ``fxpar.compile(model, "auto")``
adds to ``compile``: the whole plan chosen by the planner (:mod:`fxpar.planner.search`) from one trace of the
model and a device profile (:mod:`fxpar.cost.profiles`), the device rule, and why the plan was chosen.

Planning is pure (no process group, no randomness, ties broken by the search's fixed key), so every rank of
a world computes the same plan on its own before any communication; ``compile("auto")`` then compares the
plans once the default process group exists, and a mismatch (ranks given different batches, devices or
profiles) names both plans instead of hanging in a collective built for the wrong mesh
(:func:`plan_mismatch`; the comparison itself, which communicates, is :func:`fxpar.launch.check_same_plan`).
"""

from __future__ import annotations

import json
import os
import time
import warnings

import torch
from torch.utils import _pytree as pytree

from fxpar.cost.profiles import DeviceProfile
from fxpar.ir.batch import batch_size
from fxpar.ir.errors import PlanError
from fxpar.ir.options import run_options
from fxpar.ir.plan import Plan
from fxpar.ir.units import parse_size
from fxpar.planner.feasibility import compile_rule


def device_profile(device: str | DeviceProfile | torch.device | None = None) -> tuple[DeviceProfile, str]:
    """The device profile predictions are for, and why, in words: the one rule ``fxpar plan`` (with and
    without ``--auto``), ``fxpar train --plan auto`` and ``fxpar.compile`` follow.

    ``device``: a :class:`DeviceProfile`, or a profile name (``"h100-80gb"``, ``"cpu"``: the built-in one) or
    the JSON path ``fxpar calibrate`` wrote (``--device``): that one, as asked. A ``torch.device``: the device
    the ranks compute on; None: this machine's (its GPU when one is visible, else the CPU). A CUDA device
    gets its own profile (by its name, with the memory it reports); the CPU the profile ``$FXPAR_PROFILE``
    names, else the one ``fxpar calibrate`` wrote (``~/.cache/fxpar/profile.json``), else the built-in
    rough ``cpu`` profile."""
    from fxpar.cost.profiles import DEFAULT_PATH, load_profile, profile_for_device

    if isinstance(device, DeviceProfile):
        return device, "as given"
    if isinstance(device, str):
        return load_profile(device), "asked for"
    gpu = torch.cuda.is_available()
    dev = torch.device(device) if device is not None else torch.device("cuda" if gpu else "cpu")
    if dev.type == "cuda" and gpu:
        return profile_for_device(dev), f"this machine's GPU, {torch.cuda.get_device_name(dev)}"
    where = "no GPU on this machine" if not gpu else f"the ranks compute on the {dev.type.upper()}"
    named = run_options().profile
    if named:
        return load_profile(None), f"{where}: the profile FXPAR_PROFILE names ({named})"
    if DEFAULT_PATH.expanduser().exists():
        return load_profile(None), f"{where}: this host's profile from `fxpar calibrate` ({DEFAULT_PATH})"
    return load_profile(None), (f"{where} and no calibrated profile: the built-in rough CPU profile; "
                                "`fxpar calibrate` measures this host")


def compute_dtype(model: torch.nn.Module, plan: Plan) -> str:
    """The dtype a step of ``plan`` computes in: bf16 under ``mixed_precision="bf16"``, else the model's
    parameters' (what the roofline prices matrix products at: :mod:`fxpar.cost.roofline`)."""
    param = next(iter(model.parameters()), None)
    return "bf16" if plan.mixed_precision == "bf16" else str(param.dtype if param is not None else torch.float32)


def profile_arg(profile, device_model=None, where: str = "fxpar.compile") -> DeviceProfile | None:
    """The device profile a caller of ``compile`` / ``fxpar.api.price`` gave: ``profile=`` (a
    :class:`DeviceProfile`, a profile name or the JSON path ``fxpar calibrate`` wrote), or the deprecated
    ``device_model=`` (a DeviceProfile, with a DeprecationWarning); None when neither was given. Anything
    else (the retired ``DeviceModel``, a number) is a PlanError naming the fix."""
    fix = ("pass profile= a DeviceProfile (fxpar.cost.profiles.PROFILES['h100-80gb'], load_profile(...)) "
           "or a profile name ('h100-80gb', 'cpu') or a `fxpar calibrate` JSON path")
    if device_model is not None:
        if profile is not None:
            raise PlanError(f"{where}: both profile= and device_model= given", fix="pass profile= only")
        if not isinstance(device_model, DeviceProfile):
            raise PlanError(f"{where}: device_model={type(device_model).__name__!s} is not a DeviceProfile "
                            "(the separate device model is gone: one device type, DeviceProfile)", fix=fix)
        warnings.warn(f"{where}: device_model= is deprecated; pass profile= (a DeviceProfile or a profile name)",
                      DeprecationWarning, stacklevel=3)
        return device_model
    if profile is None or isinstance(profile, DeviceProfile):
        return profile
    if isinstance(profile, (str, os.PathLike)):
        return device_profile(str(profile))[0]
    raise PlanError(f"{where}: profile={type(profile).__name__} is not a DeviceProfile or a profile name", fix=fix)


def tp_degrees(world: int, ranks_per_node: int) -> tuple[int, ...]:
    """The tensor-parallel degrees worth pricing: the divisors of ``world`` that fit in one node (a TP group
    across nodes blocks on the slow link at every layer)."""
    cap = max(1, min(world, ranks_per_node))
    return tuple(d for d in range(1, cap + 1) if world % d == 0)


def autoplan(model: torch.nn.Module, world_size: int, *, device: str | DeviceProfile | torch.device | None = None,
             memory_per_rank: int | str | None = None, global_batch: int, seq: int, dtype: str | None = None,
             top: int = 5, costs=None, frontend: str = "auto", int8: bool = False):
    """The best plan for training ``model`` on ``world_size`` ranks of ``device``, with the ranked alternatives.

    ``device``: a profile name (``"h100-80gb"``, ``"h200-141gb"``, ``"a100-80gb"``, ``"cpu"``), the path of
    a profile ``fxpar calibrate`` wrote, a :class:`~fxpar.cost.profiles.DeviceProfile`, a ``torch.device``, or
    None for this machine's device (:func:`device_profile`: its GPU, else the calibrated CPU profile, else the
    built-in one). ``memory_per_rank``: bytes or ``"80GB"``; None takes the profile's.
    ``global_batch`` sequences of ``seq`` tokens per optimizer step. ``dtype``: ``"fp32"`` or ``"bf16"``
    (None: the model's). ``costs``: a :class:`~fxpar.planner.model_costs.ModelCosts` already computed for
    this ``seq`` (skips the trace). ``int8``: also price ZeRO-3 with int8 parameter gathers
    (``comm_dtype="int8"``, lossy: only when asked for). Returns an :class:`~fxpar.planner.search.AutoPlan`:
    ``.best`` (a :class:`Plan`), ``.estimate``, ``.ranked``, ``.rejected`` with their reasons, ``.baseline`` (the usual
    hand-made plan priced the same way) and ``.to_text()``. Raises :class:`PlanError` when nothing fits,
    naming the numbers and what would.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"fxpar.autoplan: world_size={world_size!r}; give the number of ranks (>= 1)")
    if global_batch < 1 or seq < 1:
        raise PlanError(f"fxpar.autoplan: global_batch={global_batch}, seq={seq}; both must be >= 1")
    from fxpar.planner.model_costs import model_costs
    from fxpar.planner.search import search

    profile, why = device_profile(device)
    traced = time.perf_counter()
    if costs is None:
        costs = model_costs(model, seq, tp_degrees=tp_degrees(world_size, profile.ranks_per_node), dtype=dtype,
                            frontend=frontend)
    elif costs.seq != seq:
        raise PlanError(f"fxpar.autoplan: the costs given were computed for seq={costs.seq}, not seq={seq}; "
                        "compute them again with fxpar.planner.model_costs.model_costs(model, seq)")
    chosen = search(costs, world_size, profile, global_batch=global_batch,
                    memory_per_rank=parse_size(memory_per_rank), top=top, allow=compile_rule(model), int8=int8)
    chosen.seq, chosen.profile_why = seq, why
    chosen.trace_seconds = time.perf_counter() - traced - chosen.seconds  # the trace and the per-part costs
    return chosen


def price(model: torch.nn.Module, plan: Plan | str, *, world: int | None = None,
          device: str | DeviceProfile | torch.device | None = None, global_batch: int, seq: int,
          dtype: str | None = None, memory_per_rank: int | str | None = None, frontend: str = "auto", costs=None):
    """The price of one plan: the :class:`~fxpar.cost.estimate.Estimate` the planner ranks (step time by
    part, memory by part, bytes by axis, bubble, MFU, whether it fits) for ``global_batch`` sequences of
    ``seq`` tokens on ``world`` ranks (None: the plan's degrees) of ``device`` (as :func:`autoplan`'s).
    ``dtype``: "fp32" or "bf16" (None: the model's). ``costs``: a
    :class:`~fxpar.planner.model_costs.ModelCosts` already read for this ``seq`` (skips the trace).
    Pure: no process group; what ``fxpar plan --plan`` prints and ``compiled.predicted`` holds."""
    from fxpar.cost.estimate import Pricer
    from fxpar.planner.model_costs import model_costs

    plan = Plan.parse(plan) if isinstance(plan, str) else plan
    if world is not None and world != plan.world_size:
        raise PlanError(f"fxpar.price: world={world} but the plan's degrees make {plan.world_size} ranks",
                        fix=f"pass world={plan.world_size}, or a plan whose degrees multiply to {world}")
    if global_batch < 1 or seq < 1:
        raise PlanError(f"fxpar.price: global_batch={global_batch}, seq={seq}; both must be >= 1")
    profile, _ = device_profile(device)
    if costs is None:
        costs = model_costs(model, seq, tp_degrees=(plan.tp,), sequence_parallel=(plan.sequence_parallel,),
                            dtype=dtype, frontend=frontend)
    elif costs.seq != seq:
        raise PlanError(f"fxpar.price: the costs given were computed for seq={costs.seq}, not seq={seq}")
    return Pricer(costs, profile, global_batch=global_batch,
                  memory_per_rank=parse_size(memory_per_rank)).price(plan)


def explain(auto) -> str:
    """Why ``auto`` (an :class:`~fxpar.planner.search.AutoPlan`) chose its plan, in a few lines: the plan, the
    device its times are for and why, its predicted step time and memory per rank against the runner-up's
    and the hand-made baseline's, and what ruled the others out. ``fxpar plan --auto`` and ``fxpar train
    --plan auto`` print it."""
    est = auto.estimate

    def line(what: str, e) -> str:
        return (f"  {what} {e.plan.to_text()}: {_ms(e.step_time)}/step ({e.step_time / est.step_time:.2f}x), "
                f"{_gb(e.memory['total'])} per rank")

    lines = [f"plan 'auto': {auto.best.to_text()} for {auto.world} ranks of {auto.profile.name}"
             + (f" ({auto.profile_why})" if auto.profile_why else ""),
             f"  why: the fastest of {len(auto.ranked)} plans that fit: predicted {_ms(est.step_time)}/step, "
             f"{_gb(est.memory['total'])} per rank (of {_gb(auto.profile.memory)}), MFU {100 * est.mfu:.1f}%, for a "
             f"global batch of {auto.global_batch} x {auto.seq} tokens"]
    if len(auto.ranked) > 1:
        lines.append(line("runner-up", auto.ranked[1]))
    if auto.baseline is not None:
        lines.append(line("hand-made baseline", auto.baseline)
                     + ("" if auto.baseline.fits else " (does not fit)"))
    slower = auto.reasons.get("time", 0)
    why = {"memory": "do not fit in memory", "not allowed": "refused by compile", "divisibility": "do not divide "
           "the model or the batch", "topology": "would put TP across nodes", "schedule": "refused by the schedule"}
    ruled = ", ".join(f"{n} {why.get(reason, reason)}" for reason, n in
                      sorted(auto.reasons.items(), key=lambda kv: -kv[1]) if reason != "time")
    lines.append(f"  the others: {slower} slower" + (f"; {ruled}" if ruled else "")
                 + " (fxpar plan --auto lists them)")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def example_shape(example_args: tuple, example_kwargs: dict) -> tuple[int, int]:
    """(global batch, sequence length) of an example batch: the batch from fxpar's batch rule, the length
    from ``input_ids`` (else the first tensor of two or more dims with that batch)."""
    flat, _ = pytree.tree_flatten((tuple(example_args), dict(example_kwargs)))
    batch = batch_size(flat)
    ids = example_kwargs.get("input_ids")
    tensors = ([ids] if isinstance(ids, torch.Tensor) else []) + [
        t for t in flat if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == batch]
    if not tensors or tensors[0].dim() < 2:
        raise PlanError("compile(model, 'auto') reads the sequence length from the example batch: pass "
                        "example_kwargs with input_ids of shape [batch, seq]")
    return batch, int(tensors[0].shape[1])


def plan_for_compile(model, example_args: tuple, example_kwargs: dict, *, world: int, device,
                     optimizer, frontend: str, dtype: str | None = None):
    """The AutoPlan ``compile(model, "auto")`` and ``fxpar train --plan auto`` run: :func:`autoplan` for
    ``world`` ranks of this device's profile (:func:`device_profile`), the example batch's global batch and
    length, computing in ``dtype`` (None: the model's); ``fxpar plan --auto`` calls :func:`autoplan` with the
    same rule and defaults, so the same inputs choose the same plan. Pure: every rank gets the same one
    (checked by :func:`fxpar.launch.check_same_plan`)."""
    if optimizer is None:
        raise PlanError("compile(model, 'auto') chooses a plan for training steps, and data parallelism and ZeRO "
                        "need the optimizer: pass optimizer=lambda params: torch.optim.AdamW(params, ...) "
                        "(or give a plan, e.g. compile(model, 'pp=2', ...), for inference)")
    batch, seq = example_shape(example_args, example_kwargs)
    return autoplan(model, world, device=torch.device(device), global_batch=batch, seq=seq, dtype=dtype,
                    frontend=frontend)


def plan_key(plan: Plan) -> str:
    """The plan as canonical JSON: equal plans, equal keys."""
    return json.dumps(plan.to_dict(), sort_keys=True, default=str)


def plan_mismatch(keys: list[str]) -> str | None:
    """None when every rank's :func:`plan_key` is the same, else the message naming rank 0's plan and the
    first rank's that differs."""
    other = next((r for r, key in enumerate(keys) if key != keys[0]), None)
    if other is None:
        return None
    first, second = (Plan(**json.loads(keys[r])).to_text() for r in (0, other))
    return (f"compile(model, 'auto'): the ranks chose different plans: rank 0 {first}, rank {other} {second}; "
            "every rank must pass the same model, example batch and device type (and see the same FXPAR_PROFILE)")


def announce(auto, rank: int) -> None:
    """Rank 0 prints why it chose the plan (:func:`explain`)."""
    if rank == 0:
        print("fxpar: " + explain(auto), flush=True)
