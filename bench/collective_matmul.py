"""Sequence-parallel TP step time with and without the collective matmul (``Plan(collective_matmul=k)``).

    python bench/collective_matmul.py [--steps 10] [--warmup 2] [--chunks 2 4] [--write docs/benchmarks.md]

2 gloo ranks, one thread each, a small Llama from ``LlamaConfig`` (fp32, CPU), ``Plan(tp=2,
sequence_parallel=True, collective_matmul=k)`` for k = 0 (unchunked) and each ``--chunks``, in the same
processes; steps of the plans alternate after the warm-up, each timed between barriers; median per-step
wall time on rank 0, and every step's loss compared with k = 0. On CPU the gloo transfers and the
matmuls compete for the same cores, so little overlap is to be expected here; the figure says what
chunking costs (more, smaller collectives and matmuls), not what it gains on a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import transformers

from fxpar.testing.timing import timed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import replace_section  # noqa: E402

HEADING = "### Collective matmul, tp=2 sequence parallel"

MODEL_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                    tie_word_embeddings=False)


def bench_rank(chunk_counts, steps: int, warmup: int, batch: int, seq: int) -> dict:
    import fxpar

    torch.set_num_threads(1)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    runs = {}
    for k in (0, *chunk_counts):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**MODEL_CONFIG)).train()
        runs[k] = fxpar.compile(model, fxpar.Plan(tp=2, sequence_parallel=True, collective_matmul=k),
                                example_kwargs=data, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))
    times, losses = {k: [] for k in runs}, {k: [] for k in runs}
    order = list(runs)
    for i in range(warmup + steps):
        for k in (order if i % 2 == 0 else order[::-1]):
            dt, loss = timed(lambda: runs[k].step(**data).item())  # noqa: B023
            losses[k].append(loss)
            if i >= warmup:
                times[k].append(dt)
    return {"times": times, "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--write", default=None)
    a = ap.parse_args()
    from fxpar.testing.multiproc import RankPool

    load = os.getloadavg()[0]
    with RankPool(2) as pool:
        r = pool.run(bench_rank, a.chunks, a.steps, a.warmup, a.batch, a.seq, timeout=1200)[0]
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    rows = [f"| {k} | {med[k] * 1e3:.0f} | {med[k] / med[0]:.3f} | "
            f"{max(abs(x - y) for x, y in zip(r['losses'][k], r['losses'][0])):.1e} |" for k in med]
    c = MODEL_CONFIG
    text = "\n".join([
        f"{HEADING}\n",
        f"{datetime.date.today()}, {platform.machine()} {os.cpu_count()} threads, torch {torch.__version__}. "
        f"Llama (hidden {c['hidden_size']}, {c['num_hidden_layers']} layers), fp32, batch {a.batch} x {a.seq}, "
        f"SGD; 2 gloo ranks, one thread each; {a.warmup} warm-up then {a.steps} timed steps of each plan, "
        f"interleaved (`bench/collective_matmul.py`). 1-minute load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after.\n",
        "| collective_matmul | median ms | / unchunked | worst \\|dloss\\| |", "|---|---|---|---|", *rows, "",
        "Losses are bit-equal to the unchunked path. On these 2 CPU cores gloo's communication threads and "
        "the matmuls share the same cores, so overlapping them cannot pay, and each chunk is a smaller "
        "matmul plus its own collective's overhead: the chunked path is slower here. Whether it pays on a "
        "GPU with NCCL is for measurements on several GPUs (`./dev gpu` has one); none is claimed.", ""])
    print(text)
    if a.write:
        replace_section(a.write, HEADING, text)


if __name__ == "__main__":
    main()
