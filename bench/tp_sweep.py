"""Sweep ``Plan(tp=2)`` over every causal-LM architecture transformers registers: loss and every gradient
against one process, and the share of the parameters one TP rank holds, with why the rest stays whole.

    OMP_NUM_THREADS=1 python bench/tp_sweep.py [--tp 2] [--only a,b] [--limit 120] [--json f] [--load f]
        [--write docs/benchmarks.md] [--doc docs/tensor_parallel.md]

Each name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny as ``bench/registry_sweep.py`` builds it
(``_tiny_configs.tiny_config``, train mode, dropout 0, its first inputs the forward takes). The ``tp``
gloo ranks are spawned once (``fxpar.testing.multiproc.RankPool``); per architecture each rank traces the
model, runs the tensor-parallel pass with the plan ``Plan(tp=N)`` gives it (the model's
``base_model_tp_plan``, else one inferred from the graph; only the loss kept whole, as ``fxpar.compile``
does), forward and backward, next to the eager model on one process. Status: ``equal`` (loss and every
gradient within 1e-5, gradients compared slice by slice with ``TpResult.layout(fqn).slice``),
``differs``, ``build fails`` (eager), ``trace fails``, ``tp fails`` (the pass or the rank's run),
``timeout``. The share and the reasons come from :mod:`fxpar.report.tp_coverage` on rank 0.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (the ranks load this file by path)
from _docs import replace_section  # noqa: E402
from _sweep import arguments, build, md, partial, results_of, run_sweep  # noqa: E402
from registry_sweep import TOL, _loss, _why  # noqa: E402

SECTION = "## Tensor-parallel sweep at tp={tp}"  # of docs/benchmarks.md
DOC_SECTION = "## The registry at tp={tp}"  # of docs/tensor_parallel.md
DATE = "2026-11-24"
SLACK = 0.05  # the share above 1/tp (0.55 at tp=2) that needs a written reason


def goal(tp: int) -> float:
    return round(1 / tp + SLACK, 3)


def _rank_program(program, tp: int, rank: int):
    """This rank's program as ``fxpar.compile`` makes it for ``Plan(tp=tp)``: the model's own or an
    inferred plan, only the loss kept whole when the model returns one."""
    from fxpar.passes.pipeline_split import loss_position
    from fxpar.passes.tensor_parallel import tensor_parallel

    loss = loss_position(program)
    keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
    return tensor_parallel(program, tp, rank, group="tp:" + ",".join(map(str, range(tp))), keep_outputs=keep)


def check_arch(arch: str, tp: int) -> dict:
    """On each rank: the loss and gradient differences of ``arch`` at ``tp`` against one process; rank 0
    adds the coverage (share, plan source, largest whole modules and why)."""
    import torch.distributed as dist

    import fxpar
    from fxpar.report.tp_coverage import coverage
    from fxpar.runtime import groups
    from fxpar.testing.compare import grads_by_fqn

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    groups.register_group("tp:" + ",".join(map(str, range(tp))), dist.group.WORLD)
    res: dict = {"arch": arch}
    stage = "build fails"
    try:
        model, kw = build(arch)
        stage = "trace fails"
        program = fxpar.trace(model, example_kwargs=kw)
        stage = "tp fails"
        local, info = _rank_program(program, tp, rank)
        torch.manual_seed(0)
        loss = _loss(local(**kw))
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        ref = _loss(model(**kw))
        ref.backward()
        want = grads_by_fqn(model)
        grad = 0.0
        for fqn, p in local.named_parameters():
            if p.grad is None or fqn not in want:
                continue
            layout = info.layout(fqn)
            expect = want[fqn] if layout is None else layout.slice(want[fqn], rank)
            grad = max(grad, float((p.grad - expect).abs().max()))
        res.update(loss=float((loss.detach() - ref.detach()).abs()), grad=grad)
    except Exception as e:
        return {**res, "status": stage, "why": _why(e), "where": traceback.format_exc()[-400:]}
    if rank == 0:
        cov = coverage(program.params, info)
        res.update(share=round(cov.share, 4), params=cov.total, plan="model" if program.info.tp_plan else "inferred",
                   fallbacks=len(info.fallbacks), gathered=sorted(info.gathered), by_kind=cov.by_kind,
                   shardable=round(cov.shardable_share, 4),
                   largest=[{"module": r.module, "share": round(r.replicated / cov.total, 4), "why": r.why}
                            for r in cov.largest_replicated()[:3]])
    return res


def sweep(archs: list[str], tp: int, limit: int, save=None) -> list[dict]:
    import tp_sweep  # this file as a module the ranks can load by name and path (not __main__)

    return run_sweep(tp_sweep.check_arch, archs, tp, limit, "tp fails", line, save)


def reason(r: dict) -> str:
    """Why an architecture's share is what it is: its largest whole modules, their part and reason."""
    return "; ".join(f"{x['module']} {100 * x['share']:.1f}% ({x['why']})" for x in r.get("largest", [])[:2])


def line(r: dict) -> str:
    if "share" not in r:
        return f"{r['arch']}: {r['status']} ({r.get('s', '-')} s) {r.get('why', '')}"
    return (f"{r['arch']}: {r['status']} loss {r['loss']:.1g} grad {r['grad']:.1g} share {r['share']:.3f} "
            f"({r['plan']} plan, {r['fallbacks']} fallbacks, {r.get('s', '-')} s) {reason(r)}")


def summary(results: list[dict], tp: int) -> str:
    top = goal(tp)
    equal = [r for r in results if r["status"] == "equal"]
    ran = [r for r in results if "share" in r]
    low = [r for r in ran if r["share"] <= top]
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    med = sorted(r["share"] for r in ran)[len(ran) // 2] if ran else float("nan")
    return (f"{len(equal)} of {len(results)} architectures equal one process at tp={tp} (loss and every gradient "
            f"within {TOL:g}); {len(low)} of {len(ran)} that ran hold <= {top} of their parameters per rank "
            f"(median {med:.3f}). By status: {', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}")


def table(results: list[dict], tp: int, only_notable: bool) -> str:
    """One row per architecture (``only_notable``: those not equal or above the goal)."""
    top = goal(tp)
    rows = ["| architecture | status | loss diff | grad diff | share per rank | plan | largest whole modules "
            "(part of the model, why) |", "|---|---|---|---|---|---|---|"]
    for r in results:
        notable = r["status"] != "equal" or r.get("share", 1.0) > top
        if only_notable and not notable:
            continue
        if "share" in r:
            rows.append(f"| {r['arch']} | {r['status']} | {r['loss']:.1g} | {r['grad']:.1g} | {r['share']:.3f} | "
                        f"{r['plan']} | {md(reason(r)) if r['share'] > top else ''} |")
        else:
            rows.append(f"| {r['arch']} | {r['status']} | - | - | - | - | {md(r.get('why', ''))} |")
    return "\n".join(rows)


def main() -> int:
    ap = arguments(__doc__, "tp", SECTION.format(tp="N"))
    ap.add_argument("--doc", help="replace or append the per-architecture table in this file (docs/tensor_parallel.md)")
    args = ap.parse_args()
    import transformers

    results, minutes, cmd, archs = results_of(args, "tp", "tp_sweep.py", sweep)
    for r in results:
        print(line(r))
    head = summary(results, args.tp)
    print(head)
    intro = (f"`{cmd}` ({minutes:.0f} min, {args.tp} gloo ranks spawned once, torch {torch.__version__}, "
             f"transformers {transformers.__version__}, {DATE}). Each causal-LM architecture built tiny as in the "
             f"registry sweep; `Plan(tp={args.tp})`'s plan (the model's `base_model_tp_plan`, else inferred); share: "
             f"parameter elements one TP rank holds over the model's (fxpar.report.tp_coverage); the largest "
             f"modules left whole, with their part of the model and the pass's reason, for every architecture "
             f"above {goal(args.tp)}.\n\n**{head}.**") + partial(cmd, results, archs)
    section, doc_section = SECTION.format(tp=args.tp), DOC_SECTION.format(tp=args.tp)
    if args.write:
        replace_section(args.write, section,
                        f"{section}\n\n{intro}\n\nArchitectures not equal or above {goal(args.tp)}:\n\n"
                        f"{table(results, args.tp, only_notable=True)}\n")
    if args.doc:
        replace_section(args.doc, doc_section,
                        f"{doc_section}\n\n{intro}\n\n{table(results, args.tp, only_notable=False)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
