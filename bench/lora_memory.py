"""Memory per rank of LoRA next to full fine-tuning on the same plan (issue 28's memory acceptance).

    python bench/lora_memory.py [--rank 16] [--only dp,tp] [--recompute layer] [--options fused_loss=true]
                                [--write docs/benchmarks.md]

Model: ``bench/memory_vs_peers.py``'s 168M-parameter Llama (hidden 1024, 8 layers, vocabulary 32000, untied,
fp32), saved with ``save_pretrained`` into a temporary directory; AdamW; global batch 4 x 128; 4 gloo ranks,
each runner in fresh processes. LoRA: PEFT's ``LoraConfig(r=16)`` on q, k, v, o, gate, up and down
(``fxpar.train.lora.wrap``, as ``fxpar train --lora r=16 --lora-targets ...``: a meta model wrapped, the adapters
made by PEFT on the CPU, the frozen base read per rank from the directory). Full: the same model unwrapped,
every weight trained (``bench/memory_vs_peers.py``'s fxpar runner). Plans ``dp=4,zero=3`` and ``tp=4``.

Measured per rank, as ``bench/memory_vs_peers.py`` does: the allocator's live peak over one step after two
(:class:`~fxpar.runtime.memtrack.AllocatorPeak`, the torch profiler's memory events: it changes no kernel's
allocations) and what is held when that step starts. Predicted: the Estimate's peak (``price_plan`` on
``model_costs`` of the same wrapped model) and its split (base shard, adapters, their gradients and AdamW
state, activations, buffers). The bound: base/4 + adapters + their gradients and AdamW state + activations
(the Estimate's) per rank.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import tempfile
from types import SimpleNamespace

import torch
import transformers
from _docs import replace_section  # bench/_docs.py (the script's folder is on sys.path)
from memory_vs_peers import BATCH, CONFIG, LIBRARIES, SEQ, _adamw, _batch, steady_peak

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
PLANS = {"dp": "dp=4,zero=3", "tp": "tp=4"}
SECTION = "### LoRA r=16 against full fine-tuning, memory per rank (168M Llama, 4 ranks)"


def _options(rank: int, path: str) -> SimpleNamespace:
    return SimpleNamespace(lora=f"r={rank}", lora_alpha=None, lora_targets=TARGETS, lora_dropout=None, model=path)


def _meta(lora: int | None, path: str):
    """The meta-built Llama, wrapped by PEFT for ``lora`` (its adapters' first values, made on the CPU)."""
    from fxpar.train.lora import wrap

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).train()
    return (model, None) if lora is None else wrap(model, _options(lora, path), path)


def measure(plan: str, lora: int | None, path: str) -> dict:
    """One runner on this rank: compile, two steps, then two more under the allocator's watch."""
    import fxpar
    from fxpar.adapters import AdapterWeights

    torch.set_num_threads(1)
    model, adapters = _meta(lora, path)
    weights = path if lora is None else AdapterWeights(model, path, adapters)
    compiled = fxpar.compile(model, plan, example_kwargs=_batch(), optimizer=_adamw, weights=weights, timeout=900)
    batch = _batch()

    def step():
        loss = compiled.step(**batch).item()
        compiled.optimizer.zero_grad(set_to_none=True)
        return loss

    losses = [step() for _ in range(2)]
    mem = steady_peak(step)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"peak": mem.peak, "start": mem.start, "losses": losses, "state": compiled.memory()["predicted"],
            "trained": trained, "total": sum(p.numel() for p in model.parameters())}


def predicted(plan: str, lora: int | None, path: str) -> dict:
    """The Estimate's memory on the fullest rank (default CPU profile) for the same model."""
    from fxpar.cost.profiles import load_profile
    from fxpar.ir.plan import Plan
    from fxpar.planner.model_costs import model_costs
    from fxpar.planner.price import price_plan

    model, _ = _meta(lora, path)
    p = Plan.parse(plan)
    costs = model_costs(model, SEQ, tp_degrees=(p.tp,), sequence_parallel=(False,))
    return price_plan(costs, p, load_profile(None), global_batch=BATCH).memory


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def extra_options(recompute: str, options: str) -> str:
    """The plan options both runs add to ``PLANS`` ("" for none)."""
    return ",".join(x for x in ("" if recompute == "none" else f"recompute={recompute}", options) if x)


def section(extra: str) -> str:
    """The section's heading: one per set of extra plan options, so each keeps its own table."""
    return f"{SECTION}, {extra.replace(',', ', ')}" if extra else SECTION


def markdown(rows: list[dict], rank: int, load: str, extra: str = "", flag: str = "") -> str:
    """The section; ``flag``: the script's options that chose ``extra`` (as typed, for the command line shown)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [section(extra), "",
             f"{now}, {platform.machine()} {os.cpu_count()} cores (shared, load average {load}), torch "
             f"{torch.__version__}, transformers {transformers.__version__}; `python bench/lora_memory.py{flag}`. "
             f"168M-parameter Llama (hidden 1024, 8 layers, vocabulary 32000, fp32), AdamW, global batch {BATCH} x "
             f"{SEQ}, 4 gloo ranks, each runner in fresh processes. LoRA r={rank} (PEFT) on "
             f"{TARGETS.replace(',', ', ')}; "
             "full: every weight trained. MiB, the largest rank. Measured: the allocator's live peak over one step "
             "(`AllocatorPeak`, as `bench/memory_vs_peers.py`) and what is held as it starts. Predicted: the "
             "Estimate's peak (`price_plan`), and its split: base (frozen weights' shard), trained weights, their "
             "gradients and AdamW state, activations, buffers (ZeRO-3's gathered bucket). Bound: base/4 + adapters + "
             "their gradients and AdamW state + the Estimate's activations, per rank.", "",
             "| plan | run | trained params | measured peak | held at step start | predicted peak | pred./meas. "
             "| base | trained | grads + AdamW | activations | buffers | bound | full / LoRA (measured) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    full = {r["plan"]: r for r in rows if r["lora"] is None and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| `{r['plan']}` | {r['run']} | failed: {r['error']} |" + " |" * 11)
            continue
        e, f = r["pred"], full.get(r["plan"])
        bound = r["base"] / 4 + e["params"] + e["grads"] + e["optimizer"] + e["activations"] if r["lora"] else None
        ratio = f"{f['peak'] / r['peak']:.2f}x" if r["lora"] and f else "-"
        lines.append(f"| `{r['plan']}` | {r['run']} | {r['trained'] / 1e6:.2f}M | {_mb(r['peak'])} | {_mb(r['start'])} "
                     f"| {_mb(e['total'])} | {e['total'] / r['peak']:.2f} | {_mb(e['frozen'])} | {_mb(e['params'])} "
                     f"| {_mb(e['grads'] + e['optimizer'])} | {_mb(e['activations'])} | {_mb(e['buffers'])} "
                     f"| {_mb(bound) if bound else '-'} | {ratio} |")
    return "\n".join(lines + ["", NOTES.get(extra, "")]).rstrip() + "\n"


NOTES_PLAIN = """Reading the table. Freezing takes the base's gradients, their reduction and AdamW's two moments off
every rank: what a rank holds between steps falls from 4 x its weights' shard (482 MiB) to its shard (161 MiB)
plus the adapters' weights, gradients and states (under 10 MiB). What stays is the step's activations, the
same for LoRA as for full fine-tuning, and at this batch (4 x 128 tokens over 4 ranks) they are as large as the
base's shard: the ratio full / LoRA grows with the model and falls with the batch. Under `dp=4,zero=3` the
LoRA step peaks where its forward gathers the head's bucket (125 MiB, the vocabulary's 32000 x 1024) on top of
its activations, which is why the bound, which counts no gathered bucket, is under the measured peak there.
Until 2026-11-29 gloo's own all-gather held a flat copy of that bucket beside it (546 MiB measured then); fxpar
now gathers on gloo by broadcasts into the bucket (`fxpar.runtime.dist_calls.gather_by_broadcasts`): 446."""


NOTES_RECOMPUTE = """Reading the table. With each decoder layer recomputed in backward (the same plan for both runs),
the activations fall to the layers' inputs. Under `tp=4` full fine-tuning's peak did not move (709 MiB without
recompute, 711 with): its weights, gradients and AdamW state (4 x its shard) set it, not its activations; LoRA's
fell from 362 to 252 MiB, 2.8x under full fine-tuning's. Under `dp=4,zero=3` LoRA's peak still holds the head's
gathered bucket (125 MiB) on top of the rank's shard, which adapters do not change: 2.35x. The prediction of
full fine-tuning there is 12% high; where the difference comes from was not analysed."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--only", default="dp,tp", help="which plans: dp (dp=4,zero=3), tp (tp=4)")
    ap.add_argument("--recompute", default="none", choices=["none", "layer", "selective"],
                    help="Plan.recompute of both runs (full and LoRA: the same plan)")
    ap.add_argument("--options", default="", help="more plan options of both runs, e.g. fused_loss=true")
    ap.add_argument("--write", default=None, help="markdown file whose section this run replaces")
    args = ap.parse_args()
    from fxpar.testing.multiproc import RankFailure, RankPool, set_preload

    set_preload(LIBRARIES)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    extra = extra_options(args.recompute, args.options)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).save_pretrained(d)
        gc.collect()
        for key in args.only.split(","):
            plan = ",".join(x for x in (PLANS[key], extra) if x)
            for lora in (None, args.rank):
                run = "full" if lora is None else f"LoRA r={lora}"
                row = {"plan": plan, "run": run, "lora": lora}
                with RankPool(4, timeout=1200, echo_output=False) as pool:
                    try:
                        ranks = pool.run(measure, plan, lora, d, timeout=1200)
                    except RankFailure as e:
                        rows.append({**row, "error": str(e).splitlines()[0][:200]})
                        print(f"{plan} {run} FAILED {rows[-1]['error']}", flush=True)
                        continue
                row.update(peak=max(r["peak"] for r in ranks), start=max(r["start"] for r in ranks),
                           trained=ranks[0]["trained"], base=4 * (ranks[0]["total"] - ranks[0]["trained"]),
                           per_rank=[r["peak"] for r in ranks], state=ranks[0]["state"], losses=ranks[0]["losses"])
                row["pred"] = predicted(plan, lora, d)
                rows.append(row)
                print(f"{plan} {run}: peak per rank {[_mb(x) for x in row['per_rank']]} MiB, held at start "
                      f"{_mb(row['start'])}, predicted {_mb(row['pred']['total'])} ({row['pred']}), compiled.memory "
                      f"{row['state']}, losses {[round(x, 4) for x in row['losses']]}", flush=True)
    flag = (f" --recompute {args.recompute}" if args.recompute != "none" else "") + \
        (f" --options {args.options}" if args.options else "")
    text = markdown(rows, args.rank, load, extra, flag)
    print(text)
    if args.write:
        replace_section(args.write, section(extra), text)


NOTES_FUSED = """Reading the table. The same plans with each decoder layer recomputed and the fused loss, the
memory options a LoRA user turns on, for both runs. Under `dp=4,zero=3` ZeRO-3 then leaves the head on its shards
(`passes/zero3.py`: the loss runs vocabulary-parallel over the dp group on every rank's tokens), so no rank
gathers the head's 125 MiB for the loss; LoRA's peak is where the forward starts, the embedding's bucket gathered
(125 MiB, the vocabulary's 32000 x 1024: its backward reads the token ids alone, so it is gathered once) and the
first layer's prefetched beside the rank's shard. Full fine-tuning's peak is where its backward makes the
embedding's whole gradient and reduce-scatters it. The fused loss's backward makes no gradient for a frozen
head (`linear_cross_entropy_backward`'s `weight_grad`): before that, a LoRA step held an fp32 buffer the size of
the head, on top of the head itself.
Measured 2026-11-29: full / LoRA 2.67x under `dp=4,zero=3` (2.35x with recompute alone, 2.15x with neither) and
3.16x under `tp=4` (2.82x, 1.96x); LoRA's measured peak within 3% of the prediction in both. The same options
before the head stayed on its shards and before the frozen head's dW went: 450 MiB for LoRA under `dp=4,zero=3`
(2.09x). Under `tp=4` LoRA's peak is its bound (225 MiB); under `dp=4,zero=3` it is above its bound (188 MiB) by
the two buckets gathered as the forward starts, which the bound does not count."""

NOTES = {"": NOTES_PLAIN, "recompute=layer": NOTES_RECOMPUTE,  # what each table's reading says
         "recompute=layer,fused_loss=true": NOTES_FUSED}


if __name__ == "__main__":
    sys.exit(main())
