"""The planner's cost model against measured runs: predicted vs measured step time and peak memory per rank.

    fxpar calibrate --world 8 --out PROFILE.json          # first: this host's profile (about 2 minutes)
    python bench/planner_accuracy.py [--profile PROFILE.json|NAME] [--steps 5] [--warmup 2] [--plans REGEX]
                                     [--quick] [--auto] [--no-measure] [--json OUT.json] [--write docs/benchmarks.md]

Models and plans: ``bench/_planner_models.py`` (6 small causal LMs of different shapes, among them a mixture of
experts, sliding-window attention and tied embeddings; 51 plans on 1, 2, 4 and 8 gloo ranks, with expert parallelism,
HSDP, uneven shards and recompute; fp32 AdamW on a global batch of 8 x 128). The cost model is fitted on
``fxpar calibrate``'s measurements only, never on these plans. The report gives per plan the predicted and measured
step time and peak memory with their errors, the median and worst absolute error overall and per world size, and per
model and world size whether the planner's first choice is within 5% of the measured fastest and Kendall's tau of
the predicted against the measured order. ``--plans REGEX`` keeps the plans whose ``model:plan``
text matches (``--plans 'llama:.*tp'``); ``--quick`` runs 4 llama plans with 1 warm-up and 2 timed steps.

Measured (each world size in one pool of gloo ranks, one thread each, every plan in the same processes one
after the other): ``fxpar.compile`` of the model built on the **meta device** with ``weights="init"``, so a rank
process holds only what the plan gives it (the user's model stays storage-free; no full copy to subtract).
``--warmup`` steps, then ``--steps`` steps each timed between barriers on rank 0: the step time is their median.
Then ``bench/_peak.py``'s two more steps under :class:`fxpar.runtime.memtrack.AllocatorPeak` on every rank (the
profiler's memory events, which perturb nothing): the **peak memory** of a rank is the tensor storage alive at the
second step's start (parameters, gradients kept, optimizer states, DDP buckets / ZeRO shards, the batch) plus the
most the allocator's running total rose above it during that step (activations, gradients, collective and
pipeline buffers, the optimizer's temporaries, kernels' scratch). Outside it: gloo's own buffers, the Python
interpreter and libraries. The table gives the fullest rank's peak, as the prediction does. A few plans
(``_peak.CROSS_CHECK``) are also measured by RSS and under PeakMemory's dispatch mode, printed side by side.

Predicted (in this process, no process group): ``fxpar.planner.model_costs.model_costs`` of each model once, then
``fxpar.planner.price.price_plan(costs, plan, profile, global_batch=8)`` per plan: ``step_time`` and
``memory["total"]`` (the fullest rank). ``profile``: ``fxpar.cost.profiles.load_profile(--profile)`` (default:
``$FXPAR_PROFILE``, else ``~/.cache/fxpar/profile.json`` written by ``fxpar calibrate``, else the uncalibrated
"cpu" one). The planner's first choice per model and world size (``fxpar.planner.search.search`` restricted to
the measured plans) is set against the measured fastest; ``--auto`` also measures the planner's own choice from
its whole space for each model and world size with 4 plans or more. Without the planner modules only the measured
side runs; ``--no-measure`` runs only the predictions.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import _peak  # bench/_peak.py
import _planner_models as M  # bench/_planner_models.py (the script's folder is on sys.path)
import torch
from _docs import replace_section

SECTION = "### Planner accuracy: predicted vs measured step time and peak memory"


# ---- measured: one plan on every rank of a pool --------------------------------------------------------
def measure(model: str, plan: str, steps: int, warmup: int, profile_spec: str | None = None) -> dict:
    """Compile ``plan`` for ``model`` (meta model, weights from the initialiser; pipeline cuts balanced on the
    profile's rates, as ``fxpar.compile(model, "auto")`` does), run it, time it, measure its peak memory
    (:func:`_peak.measure_peak`)."""
    import gc

    import fxpar
    from fxpar.testing.timing import timed

    torch.set_num_threads(1)
    batch = M.batch(model)
    t0 = time.perf_counter()
    from fxpar.cost.profiles import load_profile

    profile = load_profile(profile_spec)
    module, weights = M.build_for_compile(model)
    compiled = fxpar.compile(module, plan, example_kwargs=batch, optimizer=M.adamw, profile=profile, **weights)
    compile_s = time.perf_counter() - t0
    step = functools.partial(compiled.step, **batch)
    losses, times = [], []
    for _ in range(warmup):
        losses.append(step().item())
    speeds = []  # the host's reference seconds around each timed step (rank 0; host_speed)
    for _ in range(steps):
        before = host_speed()
        dt, loss = timed(step)
        speeds.append((before + host_speed()) / 2)
        times.append(dt)
        losses.append(loss.item())
    out = _peak.measure_peak(step, f"{model}:{plan}")
    held = compiled.memory().get("measured", {})
    del compiled, step
    gc.collect()
    return {"times": times, "speeds": speeds, "losses": losses, "compile_s": compile_s, "held": held, **out}


def host_speed() -> float:
    """:func:`fxpar.runtime.calibrate_step.host_reference` on rank 0 while the others wait (one core busy, as
    ``fxpar calibrate`` measures it): the host's speed just then, whatever the plan's ranks do to each other."""
    import torch.distributed as dist

    from fxpar.runtime.calibrate_step import host_reference

    got = host_reference() if dist.get_rank() == 0 else 0.0
    dist.barrier()
    return got


def run_measured(plans: list[tuple[str, str]], steps: int, warmup: int,
                 profile_spec: str | None = None) -> dict[tuple[str, str], dict]:
    """Every plan on its world size's pool (pools started one at a time, smallest world first)."""
    from fxpar.ir.plan import Plan
    from fxpar.testing.multiproc import RankFailure, RankPool

    out: dict[tuple[str, str], dict] = {}
    by_world: dict[int, list[tuple[str, str]]] = {}
    for model, plan in plans:
        by_world.setdefault(Plan.parse(plan).world_size, []).append((model, plan))
    for world in sorted(by_world):
        with RankPool(world, timeout=600, echo_output=False) as pool:
            for model, plan in by_world[world]:
                load = os.getloadavg()[0]
                t = time.perf_counter()
                try:
                    ranks = pool.run(measure, model, plan, steps, warmup, profile_spec, timeout=600)
                except RankFailure as e:
                    out[(model, plan)] = {"world": world, "error": str(e).splitlines()[0]}
                    print(f"  {model:6s} {plan:40s} FAILED: {str(e).splitlines()[0]}", flush=True)
                    continue
                times, speeds = ranks[0]["times"], ranks[0]["speeds"]
                r = {"world": world, "step_s": statistics.median(times), "times": times, "speeds": speeds,
                     # the step in seconds of the host's reference work around it (to read at a calibration's speed)
                     "step_refs": statistics.median(t / v for t, v in zip(times, speeds)),
                     "peak": max(x["peak"] for x in ranks), "peaks": [x["peak"] for x in ranks],
                     "held": [x["held"] for x in ranks], "start": [x["start"] for x in ranks],
                     "peak_new": [x["peak_new"] for x in ranks], "loss": ranks[0]["losses"][0],
                     "compile_s": max(x["compile_s"] for x in ranks), "wall_s": time.perf_counter() - t,
                     "load": (load, os.getloadavg()[0]), "cross": [x.get("cross") for x in ranks]}
                out[(model, plan)] = r
                print(f"  {model:6s} {plan:40s} {world} ranks: {r['step_s'] * 1e3:7.1f} ms, peak "
                      f"{r['peak'] / 2**20:7.1f} MiB ({r['wall_s']:.0f} s, load {load:.1f})", flush=True)
    _peak.print_cross_check(out)
    return out


# ---- predicted: the planner's cost model, in this process ---------------------------------------------
def run_predicted(plans: list[tuple[str, str]], profile_spec: str | None):
    """(profile, {(model, plan): Estimate or error text}, {(model, world): chosen plan text}); the profile is
    None (and nothing predicted) where the planner's modules are not there yet."""
    try:
        from fxpar.cost.profiles import load_profile
        from fxpar.planner.model_costs import model_costs
        from fxpar.planner.price import price_plan
    except ImportError as e:
        print(f"predictions skipped: {e}")
        return None, {}, {}
    from fxpar.ir.plan import Plan

    profile = load_profile(profile_spec)
    estimates: dict[tuple[str, str], object] = {}
    groups: dict[tuple[str, int], list[str]] = {}
    costs = {}
    for model, plan in plans:
        p = Plan.parse(plan)
        groups.setdefault((model, p.world_size), []).append(plan)
        try:
            if model not in costs:
                tps = sorted({Plan.parse(x).tp for m, x in plans if m == model})
                costs[model] = model_costs(M.build_meta(model), M.SEQ, tp_degrees=tuple(tps))
            estimates[(model, plan)] = price_plan(costs[model], p, profile, global_batch=M.BATCH)
        except Exception as e:  # noqa: BLE001 - one plan the model cannot price is reported, not fatal
            estimates[(model, plan)] = f"{type(e).__name__}: {e}"
    choice = {}
    for (model, world), texts in groups.items():
        if len(texts) > 1 and model in costs:
            choice[(model, world)] = _first_choice(costs[model], world, profile, texts, estimates, model)
    return profile, estimates, choice


def plan_text(plan) -> str:
    """``Plan.parse``-able text of ``plan``'s fields that differ from the defaults."""
    from dataclasses import fields

    return ",".join(f"{f.name}={getattr(plan, f.name)}" for f in fields(plan)
                    if f.name not in ("split_points", "tp_plan") and getattr(plan, f.name) != f.default) or "dp=1"


def same_plan(a, b) -> bool:
    """Equal plans, an unset microbatch count read as its default (one per stage)."""
    from dataclasses import replace

    def norm(p):
        return replace(p, microbatches=p.microbatches or p.pp * (p.virtual_stages or 1))
    return norm(a) == norm(b)


def auto_plans(plans: list[tuple[str, str]], profile_spec: str | None, least: int = 4) -> list[tuple[str, str]]:
    """For each model and world size with ``least`` plans or more: the planner's own choice from its whole
    space (``search`` unrestricted), where it is not among them already."""
    from fxpar.cost.profiles import load_profile
    from fxpar.ir.plan import Plan
    from fxpar.planner.model_costs import model_costs
    from fxpar.planner.search import search

    profile, out = load_profile(profile_spec), []
    groups: dict[tuple[str, int], list[Plan]] = {}
    for model, text in plans:
        groups.setdefault((model, Plan.parse(text).world_size), []).append(Plan.parse(text))
    for (model, world), group in groups.items():
        if len(group) >= least:
            best = search(model_costs(M.build_meta(model), M.SEQ), world, profile, global_batch=M.BATCH).best
            if not any(same_plan(best, p) for p in group):
                out.append((model, plan_text(best)))
    return out


def _first_choice(costs, world: int, profile, texts: list[str], estimates: dict, model: str) -> str | None:
    """The planner's pick among ``texts``: the search restricted to them, else the fastest priced plan that fits."""
    from fxpar.ir.plan import Plan

    try:
        from fxpar.planner.search import search

        best = search(costs, world, profile, global_batch=M.BATCH, plans=[Plan.parse(t) for t in texts]).best
        return next((t for t in texts if same_plan(Plan.parse(t), best)), plan_text(best))
    except Exception:  # noqa: BLE001 - the search is not there yet or refuses: rank the prices directly
        priced = [(estimates[(model, t)].step_time, t) for t in texts
                  if not isinstance(estimates.get((model, t)), (str, type(None))) and estimates[(model, t)].fits]
        return min(priced)[1] if priced else None


# ---- the report ----------------------------------------------------------------------------------------
def _err(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else (pred - meas) / meas * 100


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _fullest(m: dict, key: str):
    """``m[key]`` of the rank with the highest peak."""
    if "peaks" not in m:
        return None
    return m[key][max(range(len(m["peaks"])), key=m["peaks"].__getitem__)]


def calibration_speed(spec: str | None) -> float | None:
    """The host reference seconds ``fxpar calibrate`` recorded in the profile ``spec`` names (its median over
    the calibration: ``measurements.host_speed``), or None (a published profile, or one written before)."""
    from fxpar.cost.profiles import DEFAULT_PATH
    from fxpar.ir.options import run_options

    path = Path(spec or run_options().profile or DEFAULT_PATH).expanduser()
    try:
        return float(json.loads(path.read_text())["measurements"]["host_speed"]["reference_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def rows(plans, measured, estimates, speed: float | None = None) -> list[dict]:
    """Per plan, predicted against measured. ``speed``: the calibration's host reference seconds; the measured
    step is then read at the host's speed during the calibration (``meas_s``: its seconds of the reference
    work around it times ``speed``), beside the raw median (``raw_s``)."""
    out = []
    for model, plan in plans:
        m, e = measured.get((model, plan), {}), estimates.get((model, plan))
        est = e if e is not None and not isinstance(e, str) else None
        pt = est.step_time if est else None
        pm = est.memory["total"] if est else None
        raw = m.get("step_s")
        at = m["step_refs"] * speed if speed and m.get("step_refs") else raw
        out.append({"model": model, "plan": plan, "world": m.get("world") or _world(plan), "pred_s": pt,
                    "meas_s": at, "raw_s": raw, "raw_err": _err(pt, raw),
                    "time_err": _err(pt, at), "pred_mb": pm / 2**20 if pm else None,
                    "meas_mb": m["peak"] / 2**20 if "peak" in m else None, "mem_err": _err(pm, m.get("peak")),
                    "loss": m.get("loss"), "note": m.get("error") or (e if isinstance(e, str) else ""),
                    # for the JSON: the parts on both sides (measured: the fullest rank's)
                    "pred_memory": est.memory if est else None, "pred_parts": est.parts if est else None,
                    "meas_held": _fullest(m, "held"), "meas_peak_new": _fullest(m, "peak_new")})
    return out


def _world(plan: str) -> int:
    from fxpar.ir.plan import Plan

    return Plan.parse(plan).world_size


def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b of two orderings of the same items (ties in either counted as neither concordant nor
    discordant, and left out of that side's normaliser); None for fewer than two items or no untied pair."""
    conc = disc = tx = ty = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + tx) * (conc + disc + ty)) ** 0.5
    return (conc - disc) / denom if denom else None


def choice_rows(choice: dict, table: list[dict]) -> list[dict]:
    """Per (model, world) with two or more plans measured and predicted: the planner's first choice, the measured
    fastest, the ratio of their measured times, and Kendall's tau of the predicted against the measured order."""
    out = []
    keys = sorted({(r["model"], r["world"]) for r in table if r["world"]})
    for model, world in keys:
        group = [r for r in table if r["model"] == model and r["world"] == world and r["meas_s"] and r["pred_s"]]
        if len(group) < 2:
            continue
        pick = choice.get((model, world)) or min(group, key=lambda r: r["pred_s"])["plan"]
        fastest = min(group, key=lambda r: r["meas_s"])
        mine = next((r for r in group if r["plan"] == pick), None)
        out.append({"model": model, "world": world, "plans": len(group), "pick": pick, "fastest": fastest["plan"],
                    "ratio": mine["meas_s"] / fastest["meas_s"] if mine else None,
                    "tau": kendall_tau([r["pred_s"] for r in group], [r["meas_s"] for r in group])})
    return out


def markdown(table: list[dict], choice: dict, profile, a, seconds: float, speed: float | None = None) -> str:
    te = [abs(r["time_err"]) for r in table if r["time_err"] is not None]
    raw = [abs(r["raw_err"]) for r in table if r.get("raw_err") is not None]
    me = [abs(r["mem_err"]) for r in table if r["mem_err"] is not None]
    losses = {}
    for r in table:
        if r["loss"] is not None:
            losses.setdefault(r["model"], []).append(r["loss"])
    spread = max((max(v) - min(v) for v in losses.values()), default=0.0)
    src = (f"profile `{profile.name}` ({profile.source or 'no source given'})" if profile
           else "no profile (predictions skipped)")
    cmd = "bench/planner_accuracy.py" + (" --quick" * a.quick) + (" --auto" * a.auto) + \
        (f" --plans '{a.plans}'" if a.plans else "") + (f" --profile {a.profile}" if a.profile else "") + \
        (f" --measured {a.measured}" if a.measured else "")
    lines = [
        f"\n{SECTION}\n",
        f"{datetime.date.today().isoformat()}, {platform.machine()} {os.cpu_count()} threads, "
        f"torch {torch.__version__}, "
        f"`{cmd}` ({seconds / 60:.1f} min); {src}. Models built on the meta device, weights from the initialiser on "
        f"each rank (no full copy of the model in the rank processes); fp32 AdamW, global batch {M.BATCH} x {M.SEQ}; "
        f"gloo ranks with one thread each on {os.cpu_count()} cores; {a.warmup} warm-up then the median of {a.steps} "
        "timed steps (barrier to barrier, rank 0). Peak memory: the fullest rank's tensor storage at the start of "
        "one more step (parameters, gradients, optimizer states, buckets and shards) plus the most the allocator's "
        "running total rose above it during that step (`fxpar.runtime.memtrack.AllocatorPeak`: the torch "
        "profiler's memory events after a warm-up step under it, which change nothing about how kernels allocate; "
        "before 2026-11-27 this bench used `PeakMemory`, a dispatch mode, which makes some backward formulas "
        "allocate more). Error: (predicted - measured) / measured. "
        + (f"Measured step time at the calibration's host speed: each timed step is bracketed by "
           f"`fxpar.runtime.calibrate_step.host_reference` on rank 0 (a fixed piece of training work; the "
           f"others wait), and the median of step / reference is read at the calibration's median reference, "
           f"{speed * 1e3:.1f} ms (this shared host ran the same work up to 1.9x slower or faster within a "
           "calibration); the raw median step and its error are beside it.\n" if speed else "\n"),
        "| model | plan | ranks | predicted s | measured s | error % | raw s | raw error % | predicted MiB | "
        "measured MiB | error % |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | `{r['plan']}` | {r['world'] or 'n/a'} | {_f(r['pred_s'], '.3f')} | "
                     f"{_f(r['meas_s'], '.3f')} | {_f(r['time_err'], '+.1f')} | {_f(r.get('raw_s'), '.3f')} | "
                     f"{_f(r.get('raw_err'), '+.1f')} | {_f(r['pred_mb'], '.1f')} | "
                     f"{_f(r['meas_mb'], '.1f')} | {_f(r['mem_err'], '+.1f')} |"
                     + (f" {r['note']}" if r["note"] else ""))
    lines += ["", f"Step time: median absolute error {_f(statistics.median(te) if te else None, '.1f')}%, worst "
              f"{_f(max(te) if te else None, '.1f')}% over {len(te)} plans. Peak memory: median "
              f"{_f(statistics.median(me) if me else None, '.1f')}%, worst {_f(max(me) if me else None, '.1f')}% over "
              f"{len(me)} plans. First-step losses of one model's plans agree within {spread:.1e} (the same model, "
              "weights and batch under every plan)."
              + (f" Raw step times (as the host ran): median absolute error {statistics.median(raw):.1f}%, worst "
                 f"{max(raw):.1f}%." if speed and raw else ""), ""]
    by_world = {}
    for r in table:
        if r["time_err"] is not None:
            by_world.setdefault(r["world"], ([], []))[0].append(abs(r["time_err"]))
            if r["mem_err"] is not None:
                by_world[r["world"]][1].append(abs(r["mem_err"]))
    if by_world:
        lines += ["Absolute errors by ranks, median (worst), time / memory: " + "; ".join(
            f"{w}: {statistics.median(t):.1f}% ({max(t):.1f}%) / {_f(statistics.median(m) if m else None, '.1f')}% "
            f"({_f(max(m) if m else None, '.1f')}%) ({len(t)} plans)" for w, (t, m) in sorted(by_world.items())) + ".",
                  ""]
    picks = choice_rows(choice, table)
    if picks:
        good = sum(1 for c in picks if c["ratio"] is not None and c["ratio"] <= 1.05)
        taus = [c["tau"] for c in picks if c["tau"] is not None]
        lines += ["The planner's first choice among the measured plans of one model and world size, against the "
                  "measured fastest (ratio: the chosen plan's measured step time over the fastest's; within 5%: "
                  "ratio at most 1.05), and Kendall's tau-b of the predicted against the measured order of the "
                  "group's plans (1: the same order, -1: reversed):", "",
                  "| model | ranks | plans | planner's choice | measured fastest | measured ratio | within 5% | tau |",
                  "|---|---|---|---|---|---|---|---|",
                  *(f"| {c['model']} | {c['world']} | {c['plans']} | `{c['pick']}` | `{c['fastest']}` | "
                    f"{_f(c['ratio'], '.3f')} | "
                    f"{'n/a' if c['ratio'] is None else 'yes' if c['ratio'] <= 1.05 else 'no'}"
                    f" | {_f(c['tau'], '+.2f')} |" for c in picks), "",
                  f"The choice is the measured fastest or within 5% of it in {good} of {len(picks)} groups; median "
                  f"tau {_f(statistics.median(taus) if taus else None, '+.2f')}.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None, help="profile name or JSON path (default: load_profile(None))")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per plan (default 5; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per plan (default 2; --quick 1)")
    ap.add_argument("--plans", default=None, help="regex on 'model:plan' choosing which plans run")
    ap.add_argument("--quick", action="store_true", help="4 llama plans on 1-2 ranks, 1 warm-up, 2 timed steps")
    ap.add_argument("--auto", action="store_true", help="also measure the planner's own choice from its whole "
                    "space for every model and world size with 4 plans or more")
    ap.add_argument("--no-measure", action="store_true", help="only the predictions (and the planner's choices)")
    ap.add_argument("--json", default=None, help="write every number here")
    ap.add_argument("--measured", default=None, help="read the measured side from an earlier run's --json instead "
                    "of measuring (to price the same measurements again after a change of the cost model)")
    ap.add_argument("--write", default=None, help="replace this benchmark's section of this markdown file")
    a = ap.parse_args()
    a.steps = a.steps if a.steps is not None else (2 if a.quick else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    if a.steps < 1 or a.warmup < 1:
        ap.error("--steps and --warmup must be at least 1 (the first step builds what later steps reuse)")
    plans = M.QUICK if a.quick else M.PLANS
    if a.plans:
        plans = [(m, p) for m, p in plans if re.search(a.plans, f"{m}:{p}")]
        if not plans:
            ap.error(f"--plans {a.plans!r} matches none of {[f'{m}:{p}' for m, p in M.PLANS]}")
    t0 = time.perf_counter()
    if a.auto:
        extra = auto_plans(plans, a.profile)
        print(f"the planner's own choices added: {extra}", flush=True)
        plans = plans + extra
    profile, estimates, choice = run_predicted(plans, a.profile)
    print(f"predicted {len(estimates)} plans in {time.perf_counter() - t0:.1f} s", flush=True)
    if a.measured:
        with open(a.measured) as f:
            old = json.load(f)["measured"]
        measured = {(m, p): old[f"{m}:{p}"] for m, p in plans if f"{m}:{p}" in old}
    else:
        measured = {} if a.no_measure else run_measured(plans, a.steps, a.warmup, a.profile)
    speed = calibration_speed(a.profile)
    table = rows(plans, measured, estimates, speed)
    text = markdown(table, choice, profile, a, time.perf_counter() - t0, speed)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": table, "measured": {f"{m}:{p}": v for (m, p), v in measured.items()},
                       "choice": {f"{m}:{w}": c for (m, w), c in choice.items()},
                       "groups": choice_rows(choice, table)}, f, indent=1, default=str)
    if a.write:
        replace_section(a.write, SECTION, text)
        print(f"wrote its section of {a.write}")


if __name__ == "__main__":
    sys.exit(main())
