"""fxpar's tensor-parallel pass against DTensor's ``parallelize_module`` on the peer's own model.

    python bench/tp_vs_dtensor.py [--tp 2] [--steps 10] [--warmup 2] [--write docs/benchmarks.md]

Same processes (``--tp`` gloo ranks), same model (torch's DTensor test Transformer, enlarged: dim 256,
8 heads, 4 layers, vocab 2048, seq 128, with a cross-entropy loss; ``fxpar.testing.peers``), same data
(batch 8 x 128), same AdamW, fp32 on CPU.

* DTensor: the model's own ``Transformer.parallelize`` (``parallelize_module`` with ColwiseParallel /
  RowwiseParallel in every block, embeddings RowwiseParallel), attention on the MATH SDPA backend
  (the one DTensor runs on CPU); loss and backward as a user writes them.
* fxpar: ``fxpar.compile`` of the same model with the same plan in fxpar's vocabulary
  (``fxpar.testing.peers.PLAN``).

Both are built from the same seed, so every step's loss must agree (checked). Steps alternate
between the two after the warm-up, each between barriers; the median per-step wall time on rank 0 and
the ratio fxpar / DTensor go to the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch
from _docs import replace_section  # bench/_docs.py (the script's folder is on sys.path)

from fxpar.testing.timing import timed

ARGS = dict(n_layers=4, vocab_size=2048, max_seq_len=128, dim=256, n_heads=8)
LR = 1e-3
LOSS_TOL = 1e-4


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class FxparRunner:
    def __init__(self, tp: int, batch: dict):
        import fxpar
        from fxpar.testing import peers

        self.batch = batch
        t0 = time.perf_counter()
        self.compiled = fxpar.compile(peers.build(**ARGS), fxpar.Plan(tp=tp, tp_plan=peers.PLAN),
                                      example_kwargs=batch, optimizer=_adamw)
        self.build_s = time.perf_counter() - t0

    def step(self) -> float:
        return self.compiled.step(**self.batch).item()


class DTensorRunner:
    def __init__(self, tp: int, batch: dict):
        from torch.distributed.device_mesh import init_device_mesh

        from fxpar.testing import peers

        self.batch = batch
        t0 = time.perf_counter()
        self.model = peers.build(**ARGS)
        peers.Transformer.parallelize(self.model, init_device_mesh("cpu", (tp,)), use_seq_parallel=False)
        self.optimizer = _adamw(self.model.parameters())
        self.build_s = time.perf_counter() - t0

    def step(self) -> float:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.optimizer.zero_grad(set_to_none=True)
        with sdpa_kernel(SDPBackend.MATH):
            loss = self.model(**self.batch)["loss"]
        loss.backward()
        self.optimizer.step()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        return loss.item()


def bench_rank(tp: int, steps: int, warmup: int, batch_size: int) -> dict:
    from fxpar.testing import peers

    torch.set_num_threads(1)
    batch = peers.batch(peers.build(**ARGS), batch=batch_size, seq=ARGS["max_seq_len"])
    fx, dt = FxparRunner(tp, batch), DTensorRunner(tp, batch)
    times = {"fxpar": [], "dtensor": []}
    losses = {"fxpar": [], "dtensor": []}
    pair = (("fxpar", fx), ("dtensor", dt))
    for i in range(warmup + steps):
        for name, runner in (pair if i % 2 == 0 else pair[::-1]):
            dt_s, loss = timed(runner.step)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt_s)
    return {"times": times, "losses": losses, "build": {"fxpar": fx.build_s, "dtensor": dt.build_s}}


def section(tp: int) -> str:
    return f"### fxpar tensor parallel vs DTensor parallelize_module, tp={tp}"


def markdown(r: dict, a, load: tuple[float, float]) -> str:
    now = datetime.date.today().isoformat()
    mach = f"{platform.machine()} {os.cpu_count()} threads, {platform.system()} {platform.release()}"
    fx, dt = statistics.median(r["times"]["fxpar"]), statistics.median(r["times"]["dtensor"])
    diff = max(abs(x - y) for x, y in zip(r["losses"]["fxpar"], r["losses"]["dtensor"]))
    return "\n".join([
        f"\n{section(a.tp)}\n", f"{now}, {mach}, torch {torch.__version__}.",
        f"torch's DTensor test Transformer (dim {ARGS['dim']}, {ARGS['n_heads']} heads, {ARGS['n_layers']} layers, "
        f"vocab {ARGS['vocab_size']}, untied) with a cross-entropy loss, fp32 on CPU, batch {a.batch} x seq "
        f"{ARGS['max_seq_len']}, AdamW lr {LR}; {a.tp} gloo ranks, one torch thread each, in the same processes; "
        f"{a.warmup} warm-up steps then {a.steps} timed steps of each, interleaved, barrier to barrier on rank 0 "
        f"(`bench/tp_vs_dtensor.py`). Same plan on both sides (the model's own `parallelize`). 1-minute load "
        f"average {load[0]:.1f} before, {load[1]:.1f} after.\n",
        "| fxpar median ms | DTensor median ms | fxpar/DTensor | best ms fxpar / DTensor | build s fxpar / DTensor "
        "| loss step 1 fxpar / DTensor | worst \\|dloss\\| |",
        "|---|---|---|---|---|---|---|",
        f"| {fx * 1e3:.0f} | {dt * 1e3:.0f} | {fx / dt:.3f} | {min(r['times']['fxpar']) * 1e3:.0f} / "
        f"{min(r['times']['dtensor']) * 1e3:.0f} | {r['build']['fxpar']:.1f} / {r['build']['dtensor']:.1f} | "
        f"{r['losses']['fxpar'][0]:.6f} / {r['losses']['dtensor'][0]:.6f} | {diff:.1e} |", ""]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--write", default=None, help="replace this benchmark's section of this markdown file")
    a = ap.parse_args()
    from fxpar.testing.multiproc import RankPool

    load_before = os.getloadavg()[0]
    with RankPool(a.tp) as pool:
        r = pool.run(bench_rank, a.tp, a.steps, a.warmup, a.batch, timeout=900)[0]
    fx, dt = statistics.median(r["times"]["fxpar"]), statistics.median(r["times"]["dtensor"])
    diff = max(abs(x - y) for x, y in zip(r["losses"]["fxpar"], r["losses"]["dtensor"]))
    print(f"losses fxpar:   {', '.join(f'{x:.6f}' for x in r['losses']['fxpar'])}")
    print(f"losses DTensor: {', '.join(f'{x:.6f}' for x in r['losses']['dtensor'])}")
    print(f"median step: fxpar {fx * 1e3:.0f} ms, DTensor {dt * 1e3:.0f} ms, ratio {fx / dt:.3f}; worst |dloss| "
          f"{diff:.1e}; build fxpar {r['build']['fxpar']:.1f} s, DTensor {r['build']['dtensor']:.1f} s")
    if a.write:
        replace_section(a.write, section(a.tp), markdown(r, a, (load_before, os.getloadavg()[0])))
        print(f"wrote its section of {a.write}")
    if diff > LOSS_TOL:
        print(f"WARNING: losses differ by more than {LOSS_TOL}: the comparison is not fair")
        sys.exit(1)


if __name__ == "__main__":
    main()
