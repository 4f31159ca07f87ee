"""Memory per rank, fxpar next to its peers on the same model, batch and ranks, in one run.

    python bench/memory_vs_peers.py [--steps 2] [--only NAME,NAME] [--no-predict] [--write docs/benchmarks.md]

Model: a 168M-parameter Llama (hidden 1024, 8 layers, 16 heads, MLP 2816, vocabulary 32000, untied, fp32),
saved with ``save_pretrained`` into a temporary directory; AdamW; global batch 4 x 128; 4 gloo ranks, each
its own fresh process for every runner (a :class:`~fxpar.testing.multiproc.RankPool` per runner).

Runners, grouped by what they are compared on:

* dp=4 ZeRO-3: fxpar ``dp=4,zero=3`` (a meta model, ``weights=`` the directory) and torch FSDP2
  (``from_pretrained`` on every rank, ``fully_shard`` on each decoder layer and the root, torchtitan's wrapping).
* tp=4: fxpar ``tp=4`` (meta model, ``weights=``), transformers' own
  ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=4))`` and DTensor's ``parallelize_module``
  (``from_pretrained``, then the model's ``base_model_tp_plan`` as ``ColwiseParallel`` / ``RowwiseParallel``,
  torchtitan's Llama plan: embedding and LM head whole-output, every projection of every layer cut).
* tp=2 x ZeRO-3 over 2: fxpar ``dp=2,tp=2,zero=3`` and transformers'
  ``DistributedConfig(tp_size=2, fsdp_size=2)``.
* fxpar alone, for the cost model: ``dp=4`` with ZeRO 0, 1 and 2, and ``pp=4``.

Every rank is given its replica's rows of the global batch (all 4 rows under pure TP). Measured per rank:

* RSS (``/proc/self/status``) above the process's baseline, taken when the job starts (torch, transformers and
  every runner's libraries imported: :data:`LIBRARIES`): held after set-up, peak during set-up, held after the
  steps, and the peak during the steps (``VmHWM`` after writing 5 to ``/proc/self/clear_refs`` once set-up is done);
* live tensor bytes (:func:`fxpar.runtime.memtrack.storage_bytes` over every live tensor, meta and DTensor
  wrappers excluded) after set-up and after the steps, and the peak of one more step as the allocator saw it
  (:class:`~fxpar.runtime.memtrack.AllocatorPeak`, the torch profiler's memory events: unlike a dispatch mode it
  changes no kernel's allocations): the figure the cost model predicts.

Every runner drops its gradients after the optimizer step (``optimizer.zero_grad(set_to_none=True)``; fxpar:
``compiled.optimizer``), as a training loop does.

The table gives the largest rank of each figure and, for fxpar, the planner's predicted peak per rank
(``fxpar.planner.price.price_plan``, the default CPU profile) against the measured live peak.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from _docs import replace_section  # bench/_docs.py (the script's folder is on sys.path)

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
              tie_word_embeddings=False, use_cache=False)
BATCH, SEQ, LR = 4, 128, 1e-4
SECTION = "### Memory per rank next to FSDP2, transformers' DistributedConfig and DTensor (168M Llama, 4 ranks)"
# (name, group, plan or peer): fxpar runners carry their plan text
RUNNERS = [
    ("fxpar dp=4 zero=3", "dp=4 ZeRO-3", "dp=4,zero=3"),
    ("FSDP2 fully_shard", "dp=4 ZeRO-3", None),
    ("fxpar tp=4", "tp=4", "tp=4"),
    ("transformers tp_size=4", "tp=4", None),
    ("DTensor parallelize_module tp=4", "tp=4", None),
    ("fxpar dp=2 tp=2 zero=3", "tp=2 x ZeRO-3", "dp=2,tp=2,zero=3"),
    ("transformers tp_size=2 fsdp_size=2", "tp=2 x ZeRO-3", None),
    ("fxpar dp=4", "fxpar", "dp=4"),
    ("fxpar dp=4 zero=1", "fxpar", "dp=4,zero=1"),
    ("fxpar dp=4 zero=2", "fxpar", "dp=4,zero=2"),
    ("fxpar pp=4", "fxpar", "pp=4"),
]


# What any runner imports, imported by every process before its baseline (the pool's forkserver preloads
# them), so that the table compares what each runner holds for the model, not the code it loads: the first
# torch.export alone imports about 600 modules (networkx through AOTAutograd's partitioner, functorch,
# inductor pieces), some 60-80 MB of a process.
LIBRARIES = ["torch.export", "torch._functorch.aot_autograd", "torch._export", "torch.distributed.fsdp",
             "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "transformers.distributed",
             "transformers.core_model_loading", "accelerate", "safetensors.torch", "fxpar.api"]


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _batch() -> dict:
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _live() -> int:
    from fxpar.runtime.memtrack import live_tensors, storage_bytes

    gc.collect()
    return storage_bytes(live_tensors())


def _rows(replica: int, replicas: int) -> dict:
    n = BATCH // replicas
    return {k: v[replica * n:(replica + 1) * n] for k, v in _batch().items()}


# ---- the runners: each returns a step function (one optimizer step on this rank's share) ---------------
def _fxpar(path: str, plan: str):
    import fxpar

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).train()
    compiled = fxpar.compile(meta, plan, example_kwargs=_batch(), optimizer=_adamw, weights=path, timeout=600)
    batch = _batch()

    def step():  # as the peers' loops: the gradients dropped after the optimizer step
        loss = compiled.step(**batch).item()
        compiled.optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def _eager_step(model, batch: dict, opt):
    def step():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
    return step


def _fsdp2(path: str):
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return _eager_step(model, _rows(dist.get_rank(), dist.get_world_size()), _adamw(model.parameters()))


def _transformers(path: str, tp: int, fsdp: int):
    from transformers import DistributedConfig

    for k, v in (("LOCAL_RANK", dist.get_rank()), ("RANK", dist.get_rank()), ("WORLD_SIZE", dist.get_world_size())):
        os.environ.setdefault(k, str(v))
    kw = {"tp_size": tp, **({"fsdp_size": fsdp} if fsdp > 1 else {})}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**kw)).train()
    # the mesh is (pp, dp_replicate, fsdp, tp), tp innermost: this rank's fsdp coordinate is its data replica
    batch = _rows(dist.get_rank() // tp, fsdp)
    return _eager_step(model, batch, _adamw(model.parameters()))


def _dtensor(path: str, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    mesh = init_device_mesh("cpu", (tp,))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    return _eager_step(model, _batch(), _adamw(model.parameters()))


def _setup(name: str, plan: str | None, path: str):
    if plan is not None:
        return _fxpar(path, plan)
    if name.startswith("FSDP2"):
        return _fsdp2(path)
    if name.startswith("DTensor"):
        return _dtensor(path, 4)
    return _transformers(path, *((4, 1) if "tp_size=4" in name else (2, 2)))


def measure(name: str, plan: str | None, path: str, steps: int) -> dict:
    """One runner on this rank: set up, ``steps`` optimizer steps, then two more under the allocator's
    watch (:class:`~fxpar.runtime.memtrack.AllocatorPeak`: a warm-up, then the measured step)."""
    from fxpar.runtime.memtrack import AllocatorPeak

    torch.set_num_threads(1)
    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    t = time.perf_counter()
    with AllocatorPeak() as setup:  # what set-up allocates, from nothing (no warm-up to learn frees from)
        setup.mark()
        step = _setup(name, plan, path)
    gc.collect()
    dist.barrier()
    out = {"setup_s": time.perf_counter() - t, "setup_peak": _status("VmHWM") - base,
           "setup_held": _status("VmRSS") - base, "setup_live": _live(),
           "setup_live_peak": setup.peak - setup.start}
    _reset_peak()
    losses = [step() for _ in range(steps)]
    dist.barrier()
    out.update(step_peak=_status("VmHWM") - base, step_held=_status("VmRSS") - base, step_live=_live(),
               losses=losses)
    out["live_peak"] = steady_peak(step).peak
    return out


def steady_peak(step):
    """The allocator's live peak over ``step`` run twice, the first a warm-up (``AllocatorPeak.mark``), every
    rank in step: the region both this bench and ``bench/lora_memory.py`` measure."""
    from fxpar.runtime.memtrack import AllocatorPeak

    gc.collect()
    dist.barrier()
    with AllocatorPeak() as mem:
        step()
        mem.mark()
        step()
    dist.barrier()
    return mem


def predicted(plans: list[str]) -> dict[str, int]:
    """The planner's predicted peak bytes on the fullest rank for each fxpar plan (default CPU profile)."""
    from fxpar.cost.profiles import load_profile
    from fxpar.ir.plan import Plan
    from fxpar.planner.model_costs import model_costs
    from fxpar.planner.price import price_plan

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).train()
    tps = tuple(sorted({Plan.parse(p).tp for p in plans}))
    costs = model_costs(meta, SEQ, tp_degrees=tps)
    profile = load_profile(None)
    return {p: price_plan(costs, Plan.parse(p), profile, global_batch=BATCH).memory["total"] for p in plans}


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def markdown(results: dict, preds: dict, args) -> str:
    now = datetime.date.today().isoformat()
    n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**CONFIG, "num_hidden_layers": 0})).parameters())
    lines = [SECTION, "",
             f"{now}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, transformers "
             f"{transformers.__version__}; `python bench/memory_vs_peers.py --steps {args.steps}`. "
             f"168M-parameter Llama (hidden 1024, 8 layers, vocabulary 32000, fp32: 673 MB; embedding and head "
             f"{n / 1e6:.0f}M), AdamW, global batch {BATCH} x {SEQ}, 4 gloo ranks, each runner in fresh processes. "
             "MiB per rank (the largest rank), above each process's baseline (torch, transformers and every runner's "
             "libraries imported: the first torch.export alone imports some 600 modules, 60-80 MB). "
             "RSS: held after set-up, peak during set-up, held after the steps, peak during the steps "
             "(`/proc/self/clear_refs` reset after set-up). Live: tensor storage bytes held after set-up, the "
             "allocator's peak during set-up (compile, or loading and sharding), held after the steps and "
             "after the steps, and the allocator's peak over one more step (`AllocatorPeak`: what the planner "
             "predicts). Every loop drops its gradients after the optimizer step. "
             "x peer: fxpar's held and peak RSS after the steps over the first peer's of its group.", "",
             "| group | runner | RSS set-up | RSS set-up peak | RSS held | RSS peak | live set-up | live set-up peak "
             "| live held | live peak | predicted | pred./live | x peer (held, peak) | set-up s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    first_peer: dict[str, dict] = {}
    for name, group, plan in RUNNERS:
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {group} | {name} | failed: {r['error']} | | | | | | | | | | | |")
            continue
        if plan is None:
            first_peer.setdefault(group, r)
    for name, group, plan in RUNNERS:
        r = results.get(name)
        if r is None or "error" in r:
            continue
        pred = preds.get(plan) if plan else None
        ratio = f"{pred / r['live_peak']:.2f}" if pred else "-"
        peer = first_peer.get(group) if plan else None
        vs = (f"{r['step_held'] / peer['step_held']:.2f}x, {r['step_peak'] / peer['step_peak']:.2f}x"
              if peer else "-")
        lines.append(f"| {group} | {name} | {_mb(r['setup_held'])} | {_mb(r['setup_peak'])} | {_mb(r['step_held'])} "
                     f"| {_mb(r['step_peak'])} | {_mb(r['setup_live'])} | {_mb(r.get('setup_live_peak'))} | "
                     f"{_mb(r['step_live'])} | "
                     f"{_mb(r['live_peak'])} | {_mb(pred)} | {ratio} | {vs} | {r['setup_s']:.0f} |")
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """Reading the table. RSS is the truth of what a process costs; the live columns count tensor storage, and
a tensor that is a view of a memory-mapped safetensors file counts its whole mapped tensor there while RSS
holds only the pages touched (transformers' loaders keep such views: its large live set-up and its small
allocator peak during set-up; fxpar copies what it reads out of the file). The allocator's peak during a
step is what fxpar's cost model predicts (predicted / live peak). fxpar's RSS after set-up stays above the
peers' by the state torch.export builds on first use in a process (with the libraries already imported it
remains after the compiled model is deleted and the heap trimmed: some 60-100 MB); its set-up's tensors
peak at its shards plus about one layer. After the steps fxpar held less in this run: each step gave its freed
heap back (`fxpar.runtime.memtrack.trim_heap`), where glibc keeps a PyTorch CPU process at its high-water mark.
That is no longer the default (`FXPAR_TRIM_STEP=1` turns it on): the next step touches those pages again, about
0.6 ns per byte here, 30% of a small model's step (170 MB of page faults per step of a 5M-parameter Gemma)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated runner names (substrings)")
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--write", default=None, help="markdown file whose section this run replaces")
    args = ap.parse_args()
    from fxpar.testing.multiproc import RankFailure, RankPool, set_preload

    set_preload(LIBRARIES)
    wanted = [r for r in RUNNERS if not args.only or any(s in r[0] for s in args.only.split(","))]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG)).save_pretrained(d)
        gc.collect()
        for name, _, plan in wanted:
            with RankPool(4, timeout=1200, echo_output=False) as pool:
                try:
                    ranks = pool.run(measure, name, plan, d, args.steps, timeout=1200)
                except RankFailure as e:
                    results[name] = {"error": str(e).splitlines()[0][:200]}
                    print(f"{name:40s} FAILED {results[name]['error']}", flush=True)
                    continue
            r = {k: max(x[k] for x in ranks) for k in ranks[0] if k != "losses"}
            r["losses"] = ranks[0]["losses"]
            results[name] = r
            print(f"{name:40s} held {_mb(r['step_held'])} MiB, peak {_mb(r['step_peak'])} MiB, set-up "
                  f"{_mb(r['setup_held'])} (peak {_mb(r['setup_peak'])}), live peak {_mb(r['live_peak'])}, "
                  f"losses {[round(x, 4) for x in r['losses']]}", flush=True)
    preds = {} if args.no_predict else predicted([p for _, _, p in wanted if p])
    text = markdown(results, preds, args)
    print(text)
    if args.write:
        replace_section(args.write, SECTION, text)


if __name__ == "__main__":
    sys.exit(main())
