"""Registry architectures under plans: one training step of ``fxpar.compile`` against the same model on one
process, plan by plan (issue 30's data-dependent architectures by default).

    OMP_NUM_THREADS=1 python bench/registry_plans.py [--world 2] [--only a,b] [--limit 300] [--json f] [--load f]
        [--write docs/benchmarks.md]

Each architecture is built tiny as ``bench/registry_sweep.py`` builds it (``_sweep.build``: its config class's
defaults shrunk by ``_tiny_configs.tiny_config``, train mode, dropout 0, ids with labels), its batch doubled to
4 rows (``_sweep.four_rows``: pp=2's microbatches and dp=2 both divide it). Plans on 2 gloo ranks spawned once:
``pp=2``, ``tp=2``, ``dp=2,zero=3``, and ``ep=2`` where the config counts more than one expert (a config field,
at any depth, whose name ends in ``experts``, e.g. ``num_experts``, ``n_routed_experts``,
``ffn_config.moe_num_experts``). Per (architecture, plan) each rank compiles the model and runs one SGD step
next to a second build on one process (``fxpar.testing.compare.train_against_reference`` with ``grads``): the
loss, every parameter's gradient (gathered with ``full_state_dict(grads=True)``) and every parameter after the
step. ``ok``: all three within 1e-5. ``refused``: a PlanError before any communication (its first line);
``fails``: a rank raised (the first line of its error).
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ (the ranks load this file by path)
from _docs import replace_section  # noqa: E402
from _sweep import arguments, build, four_rows, md, results_of, run_sweep  # noqa: E402
from registry_sweep import TOL, _why  # noqa: E402

SECTION = "## Registry architectures under plans"  # of docs/benchmarks.md
ARCHS = ["dbrx", "longcat_flash", "qwen4_exp", "qwen4_exp_text", "blt", "gemma3n_text"]
PLANS = ["pp=2", "tp=2", "dp=2,zero=3"]
EP_PLAN = "ep=2"
# why a row is not ok, as found by hand (entry "ARCH PLAN")
CAUSES: dict[str, str] = {}


def experts(cfg) -> int:
    """The largest expert count the config names: an int field, at any depth, whose name ends in ``experts``."""
    def walk(d) -> list[int]:
        found = []
        for k, v in d.items():
            if isinstance(v, dict):
                found += walk(v)
            elif str(k).endswith("experts") and isinstance(v, int) and not isinstance(v, bool):
                found.append(v)
        return found
    return max(walk(cfg.to_dict()), default=0)


def plans_of(arch: str) -> list[str]:
    from _tiny_configs import tiny_config

    return PLANS + ([EP_PLAN] if experts(tiny_config(arch)) > 1 else [])


def sgd(params):
    # SGD: Adam's normalisation would turn 1e-7 reduction-order differences of near-zero gradients into 1e-5
    return torch.optim.SGD(params, lr=0.1)


def check_arch(entry: str, world: int) -> dict:
    """On each rank: ``entry`` ("ARCH PLAN") compiled and stepped once next to one process; ``loss``, ``grad``
    (worst gradient) and ``weights`` (worst parameter after the step) differences, or a status of its own
    (``build fails``, ``refused``; a rank that raises makes the sweep's ``fails``)."""
    import fxpar
    from fxpar.ir.errors import PlanError
    from fxpar.testing.compare import train_against_reference

    warnings.filterwarnings("ignore")
    arch, plan = entry.split(" ")
    res: dict = {"arch": entry}
    try:
        model, batch = build(arch)
        ref, _ = build(arch)
    except Exception as e:
        return {**res, "status": "build fails", "why": _why(e), "where": traceback.format_exc()[-600:]}
    batch = four_rows(batch)
    try:
        compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=sgd, timeout=120)
    except PlanError as e:  # raised on every rank before any communication: the pool stays usable
        return {**res, "status": "refused", "why": _why(e)}
    r = train_against_reference(compiled, ref, sgd, batch, 1, grads=True)
    res.update(loss=r["loss"], grad=r["grad"], weights=r["weights"])
    if r["weights"] > TOL:
        res.update(status="differs", why=f"parameters after the step differ by {r['weights']:.1g}")
    return res


def sweep(archs: list[str], world: int, limit: int, save=None) -> list[dict]:
    import registry_plans  # this file as a module the ranks can load by name and path (not __main__)

    entries = [f"{a} {p}" for a in archs for p in plans_of(a)]
    return run_sweep(registry_plans.check_arch, entries, world, limit, "fails", line, save)


def line(r: dict) -> str:
    if "loss" not in r:
        return f"{r['arch']}: {r['status']} ({r.get('s', '-')} s) {r.get('why', '')}"
    return (f"{r['arch']}: {r['status']} loss {r['loss']:.1g} grad {r['grad']:.1g} weights "
            f"{r.get('weights', 0):.1g} ({r.get('s', '-')} s) {r.get('why', '')}")


def table(results: list[dict]) -> str:
    rows = ["| architecture | plan | result | loss diff | worst grad diff | worst param diff after the step | s |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        arch, plan = r["arch"].split(" ")
        ok = r["status"] == "equal"
        cause = CAUSES.get(r["arch"], "")
        result = "ok" if ok else f"{r['status']}: {md(r.get('why', ''))}"
        result += f" **Cause:** {cause}" if cause and not ok else ""
        nums = f"{r['loss']:.1g} | {r['grad']:.1g} | {r['weights']:.1g}" if "loss" in r else "- | - | -"
        rows.append(f"| {arch} | `{plan}` | {result} | {nums} | {r['s']} |")
    return "\n".join(rows)


def main() -> int:
    ap = arguments(__doc__, "world", SECTION)
    ap.set_defaults(limit=300)
    args = ap.parse_args()
    args.only = args.only or ",".join(ARCHS)
    import transformers

    results, minutes, cmd, _ = results_of(args, "world", "registry_plans.py", sweep)
    for r in results:
        print(line(r))
    ok = sum(r["status"] == "equal" for r in results)
    head = f"{ok} of {len(results)} (architecture, plan) runs ok"
    print(head)
    if args.write:
        intro = (f"`{cmd}` ({minutes:.0f} min; gloo ranks spawned once), torch {torch.__version__}, transformers "
                 f"{transformers.__version__}, {datetime.date.today()}, this 2-core CPU machine (shared). Each "
                 f"architecture built tiny as the registry sweep builds it, its batch doubled to 4 rows; one SGD "
                 f"step (lr 0.1) of `fxpar.compile` under the plan against the same model on one process. ok: the "
                 f"loss, every parameter's gradient and every parameter after the step within {TOL:g}. ep=2 where "
                 f"the config counts more than one expert (bench/registry_plans.py).")
        replace_section(args.write, SECTION, f"{SECTION}\n\n{intro}\n\n**{head}.**\n\n{table(results)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
