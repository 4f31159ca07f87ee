"""``fxpar inspect``: trace a model and print its module table, graph, picture or JSON; with ``--plan``
(tp > 1), also what that plan's tensor parallelism cuts per module, what it leaves whole and why, and
the share of the parameters one TP rank holds (:mod:`fxpar.report.tp_coverage`)."""

from __future__ import annotations

import difflib
import json
import sys

from fxpar.ir.errors import InputError
from fxpar.train.models import example_kwargs, load_model


def check_module(name: str, known, what: str) -> None:
    """``--module name`` must be one of ``known`` (module FQNs); else an :class:`InputError` saying
    ``what`` and naming the nearest ones."""
    known = [k for k in known if k]
    if name in known:
        return
    near = difflib.get_close_matches(name, known, 5, 0.6)
    top = sorted({k.split(".")[0] for k in known})
    raise InputError(f"--module {name}: {what}", path=name,
                     fix=(f"the nearest: {', '.join(near)}" if near else f"its top-level modules: {', '.join(top)}")
                     + " (`fxpar inspect MODEL --depth -1` lists every module)")


def priced_views(model, kwargs, plan_text: str | None) -> tuple:
    """With ``--plan``: (its TP coverage when tp > 1, else None; per MoE layer the load the example batch
    gives rank 0's ep group when ep > 1, else None), from one priced plan (rank 0, no process group)."""
    import fxpar

    plan = fxpar.Plan.parse(plan_text) if plan_text else None
    if plan is None or (plan.tp <= 1 and plan.ep <= 1):
        return None, None
    import torch

    from fxpar.api import price
    from fxpar.report.tp_coverage import coverage_of

    priced = price(model, plan, example_kwargs=kwargs, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return (coverage_of(priced) if plan.tp > 1 else None), (priced.ep.stats if plan.ep > 1 else None)


def cmd_inspect(args) -> int:
    import fxpar

    model = load_model(args.model, meta=args.meta, layers=args.layers)
    if args.module:  # before the trace: a typo costs no tracing
        check_module(args.module, (n for n, _ in model.named_modules()), f"{args.model} has no module {args.module!r}")
    kwargs = example_kwargs(model, args.batch, args.seq)
    program = fxpar.trace(model, example_kwargs=kwargs, frontend=args.frontend)
    if args.module:  # a module the traced graph never reaches
        from fxpar.report.table import module_rows

        check_module(args.module, module_rows(program), f"module {args.module!r} owns no node or parameter of "
                     f"{args.model}'s traced graph")
    report = fxpar.inspect(program, module=args.module, depth=None if args.depth < 0 else args.depth,
                           picture=args.dot, quiet=True)
    cov, load = priced_views(model, kwargs, getattr(args, "plan", None))
    if args.json:
        data = report.to_dict()
        if args.graph:
            data["graph"] = report.graph().splitlines()
        if cov is not None:
            data["tp_coverage"] = cov.to_dict()
        if load is not None:
            data["ep_load"] = load
        json.dump(data, sys.stdout, indent=2)
        print()
        return 0
    print(report.to_text())
    if cov is not None:
        print()
        print(cov.to_text())
    if load:
        from fxpar.runtime.expert_parallel import format_load

        print()
        print(format_load(load))
    if args.graph:
        print()
        print(report.graph())
    for pic in report.pictures:
        print(f"wrote {pic}")
    return 0
