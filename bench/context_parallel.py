"""Context parallelism at a long sequence: peak memory per rank and step time at cp = 1, 2, 4, the longest
sequence a fixed per-rank budget holds, and the cost model's prediction beside each measurement.

    OMP_NUM_THREADS=1 python bench/context_parallel.py [--seq 8192] [--cps 1,2,4] [--steps 2]
                                                       [--write docs/benchmarks.md]

An 8-layer Llama (hidden 256, intermediate 1024, 4 heads / 2 KV heads, vocabulary 256: activations, not
parameters, dominate at long sequences), fp32 on CPU, batch 1 x ``--seq`` tokens with labels, SGD with lr 0
(a step is forward + backward; the weights never change). Each plan ``cp=N`` runs on N gloo ranks spawned for
it; each rank measures its step's peak above the step's start with ``bench/_peak.measure_peak`` (the torch
profiler's memory events: they change nothing about how kernels allocate), then the median of ``--steps``
timed steps. The budget: cp=1's peak at ``--seq``; the longest sequence cp=2 holds under it is searched
among ``--seq`` x {1.5, 1.8, 2.0, 2.5} (each a multiple of 2 cp).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _docs import replace_section  # bench/_docs.py (the script's folder is on sys.path)

from fxpar.testing import multiproc

CONFIG = dict(num_hidden_layers=8, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256)
SECTION = "## Context parallelism"
DATE = "2026-11-27"


def run(cp: int, seq: int, steps: int) -> dict:
    """One rank of ``Plan(cp=cp)`` at ``seq`` tokens: its peak above the step's start, median step seconds,
    the cost model's step time and memory."""
    import _peak
    import torch.distributed as dist

    import fxpar
    from fxpar import zoo

    torch.manual_seed(0)
    model = zoo.build("llama", **CONFIG, max_position_embeddings=seq)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq))
    kw = {"input_ids": ids, "labels": ids}
    compiled = fxpar.compile(model, f"cp={cp}" if cp > 1 else "dp=1", example_kwargs=kw,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0), timeout=600)
    compiled.step(**kw)  # warm: programs built, buffers allocated
    peak = _peak.measure_peak(lambda: compiled.step(**kw), f"llama:cp={cp}")
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        compiled.step(**kw)
        times.append(time.perf_counter() - t)
    est = compiled.predicted
    return {"peak": peak["peak_new"], "time": statistics.median(times), "predicted": est.step_time,
            "predicted_act": est.memory.get("activations", 0)}


def measure(cp: int, seq: int, steps: int) -> dict:
    results = multiproc.run_on_ranks(cp, run, cp, seq, steps, timeout=3600)
    return {"peak": max(r["peak"] for r in results), "time": max(r["time"] for r in results),
            "predicted": results[0]["predicted"], "predicted_act": results[0]["predicted_act"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    start = time.time()
    rows, at = [], {}
    for cp in map(int, args.cps.split(",")):
        at[cp] = measure(cp, args.seq, args.steps)
        print(f"cp={cp} seq={args.seq}: {at[cp]}", flush=True)
    base = at[1]
    for cp, r in at.items():
        rows.append(f"| {cp} | {args.seq} | {r['peak'] / 2**20:.0f} | {r['peak'] / base['peak']:.3f} | "
                    f"{1.1 / cp:.3f} | {r['time']:.2f} | {r['time'] / base['time']:.2f} | "
                    f"{r['predicted']:.2f} | {r['predicted_act'] / 2**20:.0f} |")
    fits = []
    for factor in (1.5, 1.8, 2.0, 2.5):
        seq = int(args.seq * factor) // 4 * 4
        r = measure(2, seq, 1)
        fits.append((factor, seq, r["peak"], r["peak"] <= base["peak"]))
        print(f"cp=2 seq={seq}: peak {r['peak'] / 2**20:.0f} MiB, budget {base['peak'] / 2**20:.0f}", flush=True)
    longest = max((f for f in fits if f[3]), default=None, key=lambda f: f[1])
    text = (f"### Context parallelism at a long sequence ({DATE}, torch {torch.__version__}, this 2-core host)\n\n"
            f"`OMP_NUM_THREADS=1 python bench/context_parallel.py --seq {args.seq} --cps {args.cps} "
            f"--steps {args.steps}` ({(time.time() - start) / 60:.0f} min). An 8-layer Llama (hidden 256, 4 heads / "
            "2 KV heads, vocabulary 256), fp32, batch 1, SGD lr 0; each cp=N on N gloo ranks; peak: the largest "
            "rank's rise above the step's start (the torch profiler's memory events), so parameters and "
            "gradients count in every row; bound: 1/N of cp=1's plus 10% of that; time: the slowest rank's median step "
            "(N ranks share 2 cores); predicted: the cost model's step and activation memory for the plan.\n\n"
            "| cp | seq | peak MiB | / cp=1 | bound | step s | / cp=1 | predicted s | predicted act. MiB |\n"
            "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            f"Budget {base['peak'] / 2**20:.0f} MiB (cp=1's peak at {args.seq} tokens); cp=2's peak at longer "
            "sequences: " + ", ".join(f"{s} tokens ({f}x) {p / 2**20:.0f} MiB {'fits' if ok else 'does not fit'}"
                                      for f, s, p, ok in fits)
            + f". Longest that fits: {longest[1] if longest else 'none'} tokens "
              f"({longest[0] if longest else 0}x).\n")
    print(text)
    if args.write:
        replace_section(args.write, SECTION, text)


if __name__ == "__main__":
    sys.exit(main())
