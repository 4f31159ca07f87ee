"""fxpar demo: trace every built-in tiny model, check it against eager, and inspect one.

    ./dev demo                 # all zoo models
    ./dev demo --models llama gpt2 --out out/demo

1. Each zoo model (tiny Hugging Face configs, no download) is traced with torch.export into fxpar's IR;
   the traced program runs a train-mode forward and backward with labels on the same weights as the
   eager model, and the table shows the largest difference in loss, logits and any parameter gradient.
2. The module table (params, forward/backward FLOPs, activation bytes, share) of the tiny Llama.
3. The readable graph of one attention block, parameters shown by their FQNs.
4. A picture of the Llama graph with one cluster per module (DOT; SVG too where graphviz is installed).
5. Pipeline parallelism: the unmodified tiny Llama on 2 gloo processes (pp=2, 1F1B, 4 microbatches),
   cut automatically, 3 AdamW steps, its loss next to a single-process run, and the stage table.
6. Tensor parallelism on the same 2 processes (tp=2, sequence parallel): its loss next to the
   single-process run, and the collectives the pass put in the graph.
7. 3-D parallelism on 8 CPU processes (dp=2 x pp=2 x tp=2, ZeRO-1): the device mesh, the stage table,
   the per-layer collectives, buckets and memory per rank, 5 AdamW steps next to the single-process
   run, and a picture of the partitioned program.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import fxpar
from fxpar import zoo
from fxpar.testing.compare import grads_by_fqn, max_abs_diff_tree


def check(name: str) -> dict:
    model = zoo.build(name, seed=0)
    inputs = zoo.example_inputs(name, model, batch=2, seq=8)
    model.zero_grad(set_to_none=True)
    ref = model(**inputs)
    ref.loss.backward()
    ref_grads = grads_by_fqn(model)
    t0 = time.perf_counter()
    program = fxpar.trace(model, example_kwargs=inputs)
    t_trace = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    out = program(**inputs)
    out.loss.backward()
    grads = grads_by_fqn(model)
    return {
        "model": name, "class": type(model).__name__,
        "ops": sum(1 for n in program.nodes() if n.op == "call_function"),
        "params": sum(p.numel() for _, p in program.named_parameters()),
        "tied": len(program.tied_groups()), "trace_s": t_trace,
        "dloss": (out.loss - ref.loss).abs().item(),
        "dlogits": max_abs_diff_tree(out.logits, ref.logits),
        "dgrad": max(max_abs_diff_tree(grads[k], ref_grads[k]) for k in ref_grads),
        "program": program,
    }


def pipeline_rank(name: str, steps: int, plan: str = "pp=2,microbatches=4,schedule=1f1b") -> dict:
    """On each of 2 ranks: compile for the plan and train; rank 0 also trains the single-process reference."""
    import torch.distributed as dist

    from fxpar.ir.ops import count_collectives

    model = zoo.build(name, seed=0)
    batch = zoo.example_inputs(name, model, batch=8, seq=16)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    compiled = fxpar.compile(model, fxpar.Plan.parse(plan), example_kwargs=batch, optimizer=opt)
    losses = [compiled.step(**batch).item() for _ in range(steps)]
    ref_losses = []
    if dist.get_rank() == 0:
        ref = zoo.build(name, seed=0)
        ref_opt = opt(ref.parameters())
        for _ in range(steps):
            ref_opt.zero_grad()
            loss = ref(**batch).loss
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.item())
    counts = count_collectives(compiled.pipeline.stages[0].gm)
    return {"losses": losses, "ref": ref_losses, "table": fxpar.inspect(compiled, quiet=True).stage_table(),
            "collectives": {k: v for k, v in counts.items() if v}}


def three_d_rank(name: str, steps: int, plan: str, out: str) -> dict:
    """On each of 8 ranks: dp=2 x pp=2 x tp=2 (+ ZeRO-1); rank 0 also trains the single-process reference
    and writes the picture of the partitioned program."""
    import torch.distributed as dist

    model = zoo.build(name, seed=0)
    batch = zoo.example_inputs(name, model, batch=8, seq=16)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    compiled = fxpar.compile(model, plan, example_kwargs=batch, optimizer=opt)
    losses = [compiled.step(**batch).item() for _ in range(steps)]
    result = {"losses": losses}
    if dist.get_rank() == 0:
        ref = zoo.build(name, seed=0)
        ref_opt = opt(ref.parameters())
        result["ref"] = []
        for _ in range(steps):
            ref_opt.zero_grad()
            loss = ref(**batch).loss
            loss.backward()
            ref_opt.step()
            result["ref"].append(loss.item())
        report = fxpar.inspect(compiled, quiet=True)
        result["text"] = report.to_text().split("pipeline:", 1)[1]
        result["mesh"] = str(compiled.mesh)
        result["pictures"] = [str(p) for p in report.write_partition_picture(Path(out) / f"{name}_3d.dot")]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(zoo.ZOO_NAMES))
    ap.add_argument("--out", default="out/demo")
    args = ap.parse_args()
    torch.manual_seed(0)

    print(f"fxpar {fxpar.__version__}  torch {torch.__version__}\n")
    print("1. trace with torch.export, run forward + backward, compare with eager (train mode, labels given)")
    head = f"{'model':10s} {'class':34s} {'ops':>5s} {'params':>8s} {'tied':>4s} {'trace':>6s} " \
           f"{'|dloss|':>8s} {'|dlogits|':>9s} {'|dgrad|':>8s}"
    print(head + "\n" + "-" * len(head))
    results = {}
    for name in args.models:
        r = check(name)
        results[name] = r
        print(f"{name:10s} {r['class']:34s} {r['ops']:5d} {r['params']:8d} {r['tied']:4d} "
              f"{r['trace_s']:5.2f}s {r['dloss']:8.1e} {r['dlogits']:9.1e} {r['dgrad']:8.1e}")
    worst = max(max(r["dloss"], r["dlogits"], r["dgrad"]) for r in results.values())
    print(f"\n{len(results)} models traced; largest difference from eager: {worst:.1e}")

    name = "llama" if "llama" in results else args.models[0]
    program = results[name]["program"]
    print(f"\n2. module table of the tiny {name}\n")
    report = fxpar.inspect(program, depth=3, picture=Path(args.out) / f"{name}.dot", quiet=True)
    print(report.to_text())
    attn = next((m for m in report.rows if m.endswith("layers.0.self_attn")), None)
    if attn:
        print(f"\n3. graph of {attn} (first 14 lines)\n")
        print("\n".join(report.graph(attn).splitlines()[:14]))
    print("\n4. pictures: " + ", ".join(str(p) for p in report.pictures))

    from fxpar.testing.multiproc import RankPool

    print(f"\n5. pipeline parallelism: the unmodified tiny {name} on 2 gloo processes, pp=2, 1F1B, 4 microbatches\n")
    with RankPool(2, timeout=300) as pool:
        r0 = pool.run(pipeline_rank, name, 3)[0]
        print(r0["table"] + "\n")
        for step, (a, b) in enumerate(zip(r0["losses"], r0["ref"])):
            print(f"step {step}: pipeline loss {a:.6f}   single process {b:.6f}   |diff| {abs(a - b):.1e}")
        print("\n6. tensor parallelism: the same model on the same 2 processes, tp=2 with sequence parallel\n")
        t0 = pool.run(pipeline_rank, name, 3, "tp=2,microbatches=1,sequence_parallel=true")[0]
        print(f"collectives in each rank's graph (forward; backward mirrors them): {t0['collectives']}")
        for step, (a, b) in enumerate(zip(t0["losses"], t0["ref"])):
            print(f"step {step}: tensor-parallel loss {a:.6f}   single process {b:.6f}   |diff| {abs(a - b):.1e}")

    plan = "dp=2,pp=2,tp=2,zero=1,microbatches=2"
    print(f"\n7. 3-D parallelism: the same model on 8 gloo processes, {plan}\n")
    with RankPool(8, timeout=600) as pool:
        r = pool.run(three_d_rank, name, 5, plan, args.out)[0]
    print(f"device mesh: {r['mesh']}\npipeline:{r['text']}\n")
    for step, (x, y) in enumerate(zip(r["losses"], r["ref"])):
        print(f"step {step}: 3-D loss {x:.6f}   single process {y:.6f}   |diff| {abs(x - y):.1e}")
    print("\npicture of the partitioned program: " + ", ".join(r["pictures"]))


if __name__ == "__main__":
    main()
