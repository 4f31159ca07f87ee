"""Compile a meta-device Llama-3-70B-shaped model for pp=8 and time it (issue 3: under 30 s here).

    python bench/compile_llama70b_pp8.py [--pp 8] [--schedule 1f1b] [--write docs/benchmarks.md]

One process stands for rank 0 of 8 through torch's fake process group (collectives are no-ops), which
is all compile needs: tracing, costing, choosing cuts, splitting into stages and building the schedule
happen identically on every rank before any communication. Prints the stage table and the balance
of fxpar's cuts beside the even-layers and parameter-count splits, and the bytes each boundary carries
per microbatch (read from the stages' routing tables), checked to be the hidden state (1 x seq x hidden
x 4 B) plus only values a gradient flows through, and equal to the cost model's send/recv bytes.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxpar
from fxpar.cost import partition as P

sys.path.insert(0, str(Path(__file__).parent))
from trace_llama70b import llama3_70b_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--write", default=None)
    a = ap.parse_args()
    dist.init_process_group("fake", rank=0, world_size=a.pp, store=FakeStore())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(llama3_70b_config(80))
    model.train()
    ids = torch.zeros(a.microbatches, a.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    compiled = fxpar.compile(model, fxpar.Plan(pp=a.pp, microbatches=a.microbatches, schedule=a.schedule),
                             example_kwargs={"input_ids": ids, "labels": ids, "use_cache": False}, device="meta")
    t_compile = time.perf_counter() - t0
    report = fxpar.inspect(compiled, depth=1, quiet=True)
    prog = compiled.program
    n = len(compiled.pipeline.stages)
    ours = P.balance(P.stage_costs(prog, compiled.cuts))
    even = P.balance(P.stage_costs(prog, P.even_layer_cuts(prog, n)))
    params = P.balance(P.stage_costs(prog, P.param_count_cuts(prog, n)))
    lines = [f"Llama-3-70B-shaped, meta device, pp={a.pp} ({n} stages), {a.schedule}, {a.microbatches} microbatches "
             f"of 1 x {a.seq}",
             f"- compile (trace + cost + cuts + split + schedule): {t_compile:.1f} s",
             f"- predicted max/mean stage time: fxpar {ours:.3f}, even layers (torchtitan) {even:.3f}, "
             f"parameter count (PiPPy) {params:.3f}",
             f"- predicted step {compiled.predicted.step_time:.2f} s on {compiled.result.predicted['device']}, "
             f"bubble {100 * compiled.predicted.bubble:.1f}%"]
    lines += boundary_lines(compiled, a.seq, model.config.hidden_size)
    print(report.stage_table())
    print("\n".join(lines))
    if a.write:
        with open(a.write, "a") as f:
            f.write(f"\n### Pipeline compile of a meta-device Llama-3-70B ({time.strftime('%Y-%m-%d')}, "
                    f"{platform.machine()}, torch {torch.__version__}, transformers {transformers.__version__})\n\n"
                    + "\n".join(lines) + "\n\n```\n" + report.stage_table() + "\n```\n")
    dist.destroy_process_group()


def boundary_lines(compiled, seq: int, hidden: int) -> list[str]:
    """Bytes per boundary per microbatch, what is sent beside what the cost model priced; fails unless
    every boundary carries the hidden state plus only values that depend on an earlier stage's weights."""
    pipeline = compiled.pipeline
    state = 1 * seq * hidden * 4
    links = pipeline.links()
    out = [f"- bytes per boundary per microbatch (hidden state 1 x {seq} x {hidden} x 4 B = {state} B):"]
    for (frm, to), b in sorted(links.items()):
        extra = [n for n, _, cons in pipeline.stages[frm].sends() if to in cons]
        out.append(f"  - stage {frm} -> {to}: {b} B ({', '.join(extra)})")
    for st in pipeline.stages:
        grads = [g for g, c in zip(st.output_needs_grad, st.consumers) if c]
        assert all(grads), f"stage {st.index} sends a value no gradient flows through"
        assert st.send_bytes == sum(b for (f, _), b in links.items() if f == st.index), "cost model != sends"
        assert st.recv_bytes == sum(b for (_, t), b in links.items() if t == st.index), "cost model != sends"
    assert sorted(links) == [(s, s + 1) for s in range(len(pipeline.stages) - 1)], sorted(links)
    assert all(b == state for b in links.values()), links
    out.append(f"  - every boundary: {state} B = the hidden state only; the stage table's send/recv agree")
    return out


if __name__ == "__main__":
    main()
