"""fxpar's data parallelism against torch's: DDP vs ``DistributedDataParallel`` and ZeRO-3 vs FSDP2.

    python bench/dp_vs_torch.py [--steps 10] [--warmup 2] [--write docs/benchmarks.md]

Same processes (2 gloo ranks), same model (a small Llama from ``LlamaConfig``, seed 0 on every rank),
same global batch (8 x 128, each rank training on its half), same AdamW, fp32 on CPU.

* torch DDP: ``DistributedDataParallel(model)`` (25 MB buckets, overlapping backward); each rank's loss
  is its half's mean, and DDP averages the gradients.
* torch FSDP2: ``fully_shard`` on every decoder layer, then on the root (torchtitan's wrapping).
* fxpar: ``fxpar.compile`` of the unmodified model with ``Plan(dp=2)`` and ``Plan(dp=2, zero=3)``, called
  with the global batch (each rank runs its half).

Steps of the four alternate after the warm-up, each between barriers; the table gives the median
per-step wall time on rank 0 and the ratios fxpar / torch. Every step's loss (the global batch's mean
token loss) is compared between the pairs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys

import torch
import torch.distributed as dist
import transformers

from fxpar.testing.timing import timed

MODEL_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=False)
LR = 1e-3
LOSS_TOL = 1e-4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**MODEL_CONFIG)).train()


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _batch(batch: int, seq: int) -> dict:
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}


class Fxpar:
    def __init__(self, zero: int, batch: dict):
        import fxpar

        self.batch = batch
        self.compiled = fxpar.compile(_model(), fxpar.Plan(dp=dist.get_world_size(), zero=zero),
                                      example_kwargs=batch, optimizer=_adamw)

    def step(self) -> float:
        return self.compiled.step(**self.batch).item()

    def memory(self) -> int:
        return sum(self.compiled.memory()["measured"].values())


class Torch:
    def __init__(self, kind: str, batch: dict):
        rank, world = dist.get_rank(), dist.get_world_size()
        n = batch["input_ids"].shape[0] // world
        self.local = {k: v[rank * n:(rank + 1) * n] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        model = _model()
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model = model
        self.optimizer = _adamw(self.model.parameters())

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(**self.local).loss
        loss.backward()
        self.optimizer.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # halves of equal token counts: the global mean
        return loss.item()

    def memory(self) -> int:
        ts = [p for p in self.model.parameters()] + [p.grad for p in self.model.parameters() if p.grad is not None]
        ts += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        return sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for t in ts)


def bench_rank(steps: int, warmup: int, batch_size: int, seq: int) -> dict:
    torch.set_num_threads(1)
    batch = _batch(batch_size, seq)
    runners = {"fxpar dp": Fxpar(0, batch), "torch DDP": Torch("ddp", batch),
               "fxpar zero3": Fxpar(3, batch), "torch FSDP2": Torch("fsdp", batch)}
    times = {k: [] for k in runners}
    losses = {k: [] for k in runners}
    names = list(runners)
    for i in range(warmup + steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            dt, loss = timed(runners[name].step)
            losses[name].append(loss)
            if i >= warmup:
                times[name].append(dt)
    return {"times": times, "losses": losses, "memory": {k: r.memory() for k, r in runners.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--write", default=None)
    a = ap.parse_args()
    from fxpar.testing.multiproc import RankPool

    load = os.getloadavg()[0]
    with RankPool(2) as pool:
        r = pool.run(bench_rank, a.steps, a.warmup, a.batch, a.seq, timeout=1200)[0]
    med = {k: statistics.median(v) for k, v in r["times"].items()}
    pairs = [("fxpar dp", "torch DDP"), ("fxpar zero3", "torch FSDP2")]
    rows, bad = [], False
    for fx, th in pairs:
        diff = max(abs(x - y) for x, y in zip(r["losses"][fx], r["losses"][th]))
        bad |= diff > LOSS_TOL
        rows.append(f"| {fx} / {th} | {med[fx] * 1e3:.0f} | {med[th] * 1e3:.0f} | {med[fx] / med[th]:.3f} | "
                    f"{r['memory'][fx] / 2**20:.1f} / {r['memory'][th] / 2**20:.1f} | {r['losses'][fx][0]:.6f} / "
                    f"{r['losses'][th][0]:.6f} | {diff:.1e} |")
    c = MODEL_CONFIG
    text = "\n".join([
        f"\n### fxpar DDP and ZeRO-3 vs torch DDP and FSDP2, dp=2 ({datetime.date.today().isoformat()}, "
        f"{platform.machine()} {os.cpu_count()} threads, torch {torch.__version__})\n",
        f"Llama from LlamaConfig (hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, vocab "
        f"{c['vocab_size']}), fp32 on CPU, global batch {a.batch} x {a.seq}, AdamW lr {LR}; 2 gloo ranks, one "
        f"thread each, in the same processes; {a.warmup} warm-up then {a.steps} timed steps of each, interleaved, "
        f"barrier to barrier on rank 0 (`bench/dp_vs_torch.py`). Memory: parameters + gradients + optimizer "
        f"states held by rank 0 after the last step. 1-minute load average {load:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after.\n",
        "| fxpar / torch | fxpar median ms | torch median ms | fxpar/torch | memory MiB fxpar / torch "
        "| loss step 1 fxpar / torch | worst \\|dloss\\| |",
        "|---|---|---|---|---|---|---|", *rows, ""]) + "\n"
    print(text)
    if a.write:
        with open(a.write, "a") as f:
            f.write(text)
    if bad:
        print(f"WARNING: losses differ by more than {LOSS_TOL}: the comparison is not fair")
        sys.exit(1)


if __name__ == "__main__":
    main()
