"""``fxpar plan``: what a plan does (stages, collectives, memory, with tp > 1 the TP coverage per
module) without launching; with ``--auto`` the plan the planner chooses for a world of ranks on a device
profile, the ranked alternatives and the usual hand-made plan beside it; ``--json`` for machines.

Both say which device profile their times are for and why (:func:`fxpar.planner.auto.device_profile`: ``--device``,
else this machine's GPU, else the calibrated CPU profile, else the built-in one), the rule ``fxpar train``
and ``fxpar.compile`` follow; ``--auto`` takes ``fxpar train``'s defaults (``--batch``, ``--seq``) and calls
the same :func:`fxpar.autoplan`, so both choose the same plan for the same inputs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

import torch

from fxpar.train.models import example_kwargs, load_model


def cmd_plan(args) -> int:
    """Build rank 0 of the plan's world on this one process, without any process group
    (``fxpar.api.price``), then print the plan's stage table, collectives, memory per rank, what its
    tensor parallelism cuts and leaves whole per module, and the passes that ran with their times."""
    import fxpar
    from fxpar.api import price

    if args.auto:
        return cmd_auto(args)
    if args.world is not None:
        raise fxpar.PlanError(f"fxpar plan: --world {args.world} is for --auto (a given plan's degrees set its world)")
    from fxpar.planner.auto import device_profile

    plan = fxpar.Plan.from_file(args.plan_file) if args.plan_file else fxpar.Plan.parse(args.plan)
    profile, why = device_profile(args.device)
    model = load_model(args.model, meta=args.meta)
    if getattr(args, "lora", None):  # wrapped by PEFT as fxpar train --lora wraps it (fxpar.train.lora)
        from fxpar.train import lora

        lora.check_options(argparse.Namespace(**{**vars(args), "merge": False, "export": None}))
        model = lora.wrap(model, args, args.model if os.path.isdir(args.model) else None)[0]
    kwargs = example_kwargs(model, args.batch, args.seq)
    with warnings.catch_warnings(record=True) as caught:  # fxpar's warnings about the plan, printed plainly
        warnings.simplefilter("always")
        priced = price(model, plan, example_kwargs=kwargs, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                       profile=profile)
    for w in caught:
        print(f"fxpar: warning: {w.message}", file=sys.stderr)
    report = fxpar.inspect(priced, quiet=True)
    estimate = _estimate(model, plan, profile, args, priced)
    if getattr(args, "json", False):
        data = report.to_dict()
        data["estimate"] = dataclasses.asdict(estimate) if not isinstance(estimate, str) else {"error": estimate}
        data["passes"] = [[name, secs] for name, secs in priced.result.timings]
        if plan.ep > 1:
            data["ep_load"] = priced.ep.stats
        print(json.dumps(data, indent=2, default=str))
        return 0
    # printed as torch's DeviceMesh prints itself; no DeviceMesh is made (it would create process groups)
    mesh = _device_mesh(plan, priced.setup.dp_axis)
    print(f"plan {plan.to_dict()} on {plan.world_size} ranks, mesh {mesh}; rank 0 shown")
    print(f"predicted times are for {profile.name} ({why}); --device names another profile")
    print(report.to_text())
    if plan.ep > 1 and priced.ep.stats:  # the example batch routed on this process (rank 0's ep group)
        from fxpar.runtime.expert_parallel import format_load

        print(f"expert parallelism ep={plan.ep}: the example batch's load per MoE layer\n"
              + format_load(priced.ep.stats))
    print("passes: " + ", ".join(f"{name} {1e3 * secs:.0f} ms" for name, secs in priced.result.timings))
    from fxpar.planner.search import estimate_text

    print(estimate if isinstance(estimate, str) else estimate_text(estimate))
    return 0


def _estimate(model, plan, profile, args, priced):
    """The plan's :func:`fxpar.price` (the Estimate ``--auto`` ranks plans by) for ``--global-batch`` (else
    ``--batch``) sequences of ``--seq`` tokens on the profile, or why there is none, in words: the built
    plan's ``predicted`` (the step the stage table shows) unless ``--global-batch`` or ``--dtype`` ask for
    another batch or dtype."""
    import fxpar

    batch = args.global_batch if getattr(args, "global_batch", None) is not None else args.batch
    dtype = "bf16" if plan.mixed_precision == "bf16" else getattr(args, "dtype", None)
    try:
        if batch == args.batch and dtype == ("bf16" if plan.mixed_precision == "bf16" else None):
            return priced.predicted
        return fxpar.price(model, plan, device=profile, global_batch=batch, seq=args.seq, dtype=dtype)
    except fxpar.PlanError as e:
        return f"estimate: none ({e})"


def cmd_auto(args) -> int:
    """``fxpar plan MODEL --auto --world N``: build the model (``--meta``: no weights), price the plan space
    on the device profile (:func:`fxpar.autoplan`), print the chosen plan, its MFU, the top alternatives,
    the hand-made baseline and why the others lost (or all of it as JSON)."""
    from fxpar.ir.errors import PlanError
    from fxpar.planner.auto import autoplan

    if args.world is None:
        raise PlanError("fxpar plan --auto needs the number of ranks: --world N (e.g. --world 1024)")
    imported = _process_age()  # the interpreter's start-up and fxpar's imports, before this line
    start = time.perf_counter()
    model = load_model(args.model, meta=args.meta)
    built = time.perf_counter()
    batch = args.global_batch if args.global_batch is not None else args.batch
    # what fxpar train --plan auto calls (fxpar.planner.auto.plan_for_compile), with its defaults and device rule
    auto = autoplan(model, args.world, device=args.device, memory_per_rank=args.memory, global_batch=batch,
                    seq=args.seq, top=args.top, dtype=args.dtype)
    done = time.perf_counter()
    if args.json:
        data = auto.to_dict(top=args.top)
        data["timings"] = {"import_s": imported, "build_s": built - start, "trace_s": auto.trace_seconds,
                           "search_s": auto.seconds, "plan_s": done - built}
        print(json.dumps(data, indent=2, default=str))
        return 0
    from fxpar.planner.auto import explain

    dtype = args.dtype or _dtype(model)
    print(f"fxpar plan --auto: {args.model}, {args.world} ranks of {auto.profile.name}, global batch {batch} x "
          f"seq {args.seq}, computing in {dtype}")
    print(explain(auto) + "\n")
    print(auto.to_text(top=args.top))
    print(("" if imported is None else f"started and imported in {imported:.2f} s, ")
          + f"model built in {built - start:.2f} s, traced and costed in {auto.trace_seconds:.2f} s, "
          f"searched in {auto.seconds:.2f} s ({done - built:.2f} s planning)")
    return 0


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), else None."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks after boot
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _device_mesh(plan, dp_axis: str) -> str:
    """``DeviceMesh((dp_shard=2, pp=2, tp=2), 'cpu', stride=(4, 2, 1))``: the mesh ``plan`` runs on (fxpar.ir.mesh):
    HSDP's dp as ``(dp_replicate, dp_shard)``, replicas outermost; ``ep`` after dp, ``cp`` before tp where > 1."""
    dims = [("dp_replicate", plan.dp_replicate), ("dp_shard", plan.dp_shard)] if plan.dp_replicate > 1 \
        else [(dp_axis, plan.dp)]
    dims += [("ep", plan.ep)] * (plan.ep > 1) + [("pp", plan.pp)] + [("cp", plan.cp)] * (plan.cp > 1)
    dims.append(("tp", plan.tp))
    strides = [1]
    for _, n in reversed(dims[1:]):
        strides.insert(0, strides[0] * n)
    return (f"DeviceMesh(({', '.join(f'{a}={n}' for a, n in dims)}), 'cpu', "
            f"stride=({', '.join(map(str, strides))}))")
