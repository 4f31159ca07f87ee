"""Pipeline-parallel training of an unmodified Hugging Face model with fxpar, under torchrun.

    torchrun --nproc_per_node 4 examples/pipeline_hf.py --model llama --schedule interleaved_1f1b
    torchrun --nproc_per_node 2 examples/pipeline_hf.py --model gpt2 --schedule zbv --steps 5

Every rank builds the same model (same seed), compiles it for the plan and calls ``step`` with the same
batch; rank 0 prints the stage table and the loss next to a single-process reference run.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import fxpar
from fxpar import zoo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", choices=zoo.CAUSAL_LM_NAMES)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = zoo.build(a.model, seed=0)
    batch = zoo.example_inputs(a.model, model, batch=a.batch, seq=a.seq)
    opt = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    compiled = fxpar.compile(model, fxpar.Plan(pp=world, microbatches=a.microbatches, schedule=a.schedule),
                             example_kwargs=batch, optimizer=opt)
    if rank == 0:
        print(fxpar.inspect(compiled, depth=1, quiet=True).stage_table(), "\n")
    reference = zoo.build(a.model, seed=0)
    ref_opt = opt(reference.parameters())
    for step in range(a.steps):
        loss = compiled.step(**batch)
        ref_opt.zero_grad()
        ref_loss = reference(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        if rank == 0:
            print(f"step {step}: fxpar loss {loss.item():.6f}   single-process {ref_loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
