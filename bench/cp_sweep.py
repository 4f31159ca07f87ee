"""Sweep ``Plan(cp=N)`` over every causal-LM architecture transformers registers: loss and every gradient
against one process.

    OMP_NUM_THREADS=1 python bench/cp_sweep.py [--cp 2] [--only a,b] [--limit 120] [--json f] [--load f]
        [--write docs/benchmarks.md]

Each name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is built tiny as ``bench/registry_sweep.py`` builds it
(``_tiny_configs.tiny_config``, train mode, dropout 0, its first inputs the forward takes), on a sequence of
``SEQ`` = 16 tokens (``2 * cp`` chunks of 4 tokens at cp=2, of 2 at cp=4). The ``cp`` gloo ranks are spawned
once (``fxpar.testing.multiproc.RankPool``); per architecture each rank traces the model, runs the context-
parallel pass for its rank (only the loss kept whole, as ``fxpar.compile`` does), forward and backward, next
to the eager model on one process; each parameter's gradient is summed over the cp ranks (as the data-
parallel engine sums it over dp x cp). Status: ``equal`` (loss and every gradient within 1e-5),
``differs``, ``build fails`` (eager), ``trace fails``, ``cp fails`` (the pass or the rank's run), ``timeout``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (the ranks load this file by path)
from _docs import replace_section  # noqa: E402
from _sweep import arguments, build, md, partial, results_of, run_sweep  # noqa: E402
from registry_sweep import TOL, _loss, _why  # noqa: E402

SECTION = "## Context-parallel sweep at cp={cp}"  # of docs/benchmarks.md
DATE = "2026-11-27"
SEQ = 16  # cuts into 2 x cp chunks for cp = 2 and 4


def group_name(cp: int) -> str:
    return "cp:" + ",".join(map(str, range(cp)))


def _rank_program(program, cp: int, rank: int):
    """This rank's program as ``fxpar.compile`` makes it for ``Plan(cp=cp)``: only the loss kept whole when
    the model returns one."""
    from fxpar.passes.context_parallel import context_parallel
    from fxpar.passes.pipeline_split import loss_position

    loss = loss_position(program)
    keep = None if loss is None else {[i for i, b in enumerate(program.outputs) if b.kind == "user"][loss]}
    return context_parallel(program, cp, rank, group_name(cp), keep_outputs=keep)


def check_arch(arch: str, cp: int) -> dict:
    """On each rank: the loss and gradient differences of ``arch`` at ``cp`` against one process (gradients
    summed over the ranks); rank 0 adds what the pass did (attentions, gathers, fallbacks)."""
    import torch.distributed as dist

    import fxpar
    from fxpar.runtime import groups
    from fxpar.testing.compare import grads_by_fqn

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    groups.register_group(group_name(cp), dist.group.WORLD)
    res: dict = {"arch": arch}
    stage = "build fails"
    try:
        model, kw = build(arch, SEQ)
        stage = "trace fails"
        program = fxpar.trace(model, example_kwargs=kw)
        stage = "cp fails"
        local, info = _rank_program(program, cp, rank)
        torch.manual_seed(0)
        loss = _loss(local(**kw))
        loss.backward()
        # the program shares the model's parameters: its gradients, summed over cp, taken before the reference
        got = {}
        for fqn, p in sorted(local.named_parameters()):  # the same order on every rank: one all-reduce each
            g = torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            dist.all_reduce(g)
            got[fqn] = (g, p.grad is None)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        ref = _loss(model(**kw))
        ref.backward()
        want = grads_by_fqn(model)
        grad, missing, worst = 0.0, [], ""
        for fqn, (g, none) in got.items():
            if fqn not in want:
                continue
            if none and want[fqn].abs().max() > 0:
                missing.append(fqn)
            d = float((g - want[fqn]).abs().max())
            grad, worst = max(grad, d), fqn if d > grad else worst
        res.update(loss=float((loss.detach() - ref.detach()).abs()), grad=grad, worst=worst)
        if missing:
            res.update(grad=float("inf"), why=f"no gradient for {missing[:3]}")
    except Exception as e:
        return {**res, "status": stage, "why": _why(e), "where": traceback.format_exc()[-400:]}
    if rank == 0:
        res.update(seq=info.seq, attention=len(info.attention), kv_gathers=len(info.kv_gathers),
                   gathered=sorted(set(info.gathered)), cut=len(info.cut))
    return res


def sweep(archs: list[str], cp: int, limit: int, save=None) -> list[dict]:
    import cp_sweep  # this file as a module the ranks can load by name and path (not __main__)

    return run_sweep(cp_sweep.check_arch, archs, cp, limit, "cp fails", line, save)


def line(r: dict) -> str:
    if "loss" not in r:
        return f"{r['arch']}: {r['status']} ({r.get('s', '-')} s) {r.get('why', '')}"
    return (f"{r['arch']}: {r['status']} loss {r['loss']:.1g} grad {r['grad']:.1g} ({r.get('attention', '-')} "
            f"attentions, {r.get('kv_gathers', '-')} kv gathers, gathered at {r.get('gathered', [])[:4]}, "
            f"{r.get('s', '-')} s) {r.get('why', '')}" + (f" worst {r['worst']}" if r["status"] == "differs" else ""))


def summary(results: list[dict], cp: int) -> str:
    equal = [r for r in results if r["status"] == "equal"]
    traced = [r for r in results if r["status"] not in ("build fails", "trace fails")]
    counts: dict = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    split = [r for r in equal if r.get("attention") or r.get("kv_gathers")]
    clean = [r for r in split if not r.get("gathered")]
    return (f"{len(equal)} of {len(traced)} architectures that fxpar.trace captures ({len(results)} swept) equal "
            f"one process at cp={cp} (loss and every gradient within {TOL:g}); in {len(split)} of them attention "
            f"reads this rank's query rows against gathered keys and values ({len(clean)} with no op gathered by "
            f"the fallback), the others gather the sequence before it or have no attention. By status: "
            f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items()))}")


def table(results: list[dict]) -> str:
    """One row per architecture not equal, with the reason."""
    rows = ["| architecture | status | loss diff | grad diff | reason |", "|---|---|---|---|---|"]
    for r in results:
        if r["status"] == "equal":
            continue
        if "loss" in r:
            rows.append(f"| {r['arch']} | {r['status']} | {r['loss']:.1g} | {r['grad']:.1g} | "
                        f"{md(r.get('reason') or r.get('why', ''))} |")
        else:
            rows.append(f"| {r['arch']} | {r['status']} | - | - | {md(r.get('reason') or r.get('why', ''))} |")
    return "\n".join(rows)


def main() -> int:
    ap = arguments(__doc__, "cp", SECTION.format(cp="N"))
    ap.add_argument("--reasons", help="a JSON file {architecture: why} read into the table for those not equal")
    args = ap.parse_args()
    import transformers

    results, minutes, cmd, archs = results_of(args, "cp", "cp_sweep.py", sweep)
    if args.reasons:
        with open(args.reasons) as f:
            why = json.load(f)
        for r in results:
            r["reason"] = why.get(r["arch"], "")
    for r in results:
        print(line(r))
    head = summary(results, args.cp)
    print(head)
    intro = (f"`{cmd}` ({minutes:.0f} min, {args.cp} gloo ranks spawned once, torch {torch.__version__}, "
             f"transformers {transformers.__version__}, {DATE}). Each causal-LM architecture built tiny as in the "
             f"registry sweep, batch 2 x seq {SEQ}; each rank runs `context_parallel` (fxpar/passes/"
             f"context_parallel.py) on the traced program, forward and backward; the loss and every parameter's "
             f"gradient summed over the cp ranks against the eager model on one process.\n\n**{head}.**"
             ) + partial(cmd, results, archs)
    section = SECTION.format(cp=args.cp)
    if args.write:
        replace_section(args.write, section,
                        f"{section}\n\n{intro}\n\nArchitectures not equal, with the reason:\n\n{table(results)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
