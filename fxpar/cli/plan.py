"""``fxpar plan``: what a plan does (stages, collectives, memory) without launching."""

from __future__ import annotations

import torch

from fxpar.train.models import example_kwargs, load_model


def cmd_plan(args) -> int:
    """Build rank 0 of the plan's world on this one process, without any process group
    (``fxpar.api.price``), then print the plan's stage table, collectives, memory per rank and the
    passes that ran with their times."""
    import fxpar
    from fxpar.api import price

    plan = fxpar.Plan.from_file(args.plan_file) if args.plan_file else fxpar.Plan.parse(args.plan)
    model = load_model(args.model, meta=args.meta)
    kwargs = example_kwargs(model, args.batch, args.seq)
    priced = price(model, plan, example_kwargs=kwargs, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    dp_axis = "dp_shard" if plan.zero else "dp_replicate"
    # printed as torch's DeviceMesh prints itself; no DeviceMesh is made (it would create process groups)
    mesh = (f"DeviceMesh(({dp_axis}={plan.dp}, pp={plan.pp}, tp={plan.tp}), 'cpu', "
            f"stride=({plan.pp * plan.tp}, {plan.tp}, 1))")
    print(f"plan {plan.to_dict()} on {plan.world_size} ranks, mesh {mesh}; rank 0 shown")
    print(fxpar.inspect(priced, quiet=True).to_text())
    print("passes: " + ", ".join(f"{name} {1e3 * secs:.0f} ms" for name, secs in priced.result.timings))
    return 0
