"""The training loop behind ``fxpar train`` and ``examples/train_hf.py`` (run under torchrun).

Every rank builds the model (a zoo name or an HF ``config.json``; on the meta device when asked, with
weights from ``--resume`` or the initialiser), compiles it for the plan, and trains on synthetic data
(random tokens, seeded per step) or a text file (UTF-8 bytes as token ids, consecutive windows).
Rank 0 logs a progress bar, the loss, the global gradient norm (with ``--max-grad-norm``), tokens/s and
the memory per rank (params + grads + optimizer states); ``--save DIR --save-every K`` writes
checkpoints (fxpar.checkpoint), ``--resume DIR`` continues from the last complete one, ``--export DIR``
writes a Hugging Face model at the end.

Resuming reproduces the uninterrupted run: the weights and the optimizer state come from the
checkpoint (each rank reads its own shards, under any plan), the data stream skips the steps already taken (synthetic batches are seeded by step)
and every step seeds the RNG from ``(--seed, step)``. So ``torchrun --max-restarts 1 -m fxpar train ...
--save DIR --save-every K --resume DIR`` survives a lost rank: torchrun starts the group again, and
the new run continues from the last checkpoint with the same per-step losses.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from fxpar.cli.models import load_model
from fxpar.ir.errors import PlanError


def batches(data: str, vocab: int, batch: int, seq: int, seed: int):
    """Endless (step, input_ids) pairs: random tokens, or windows over a text file's bytes."""
    if data == "synthetic":
        step = 0
        while True:
            g = torch.Generator().manual_seed(seed + step)
            yield torch.randint(0, vocab, (batch, seq), generator=g)
            step += 1
    raw = torch.tensor(list(Path(data).read_bytes()), dtype=torch.long) % vocab
    need = batch * seq
    if raw.numel() < need:
        raise SystemExit(f"fxpar train: {data} has {raw.numel()} bytes, fewer than one batch ({batch} x {seq})")
    pos = 0
    while True:
        if pos + need > raw.numel():
            pos = 0
        yield raw[pos:pos + need].view(batch, seq)
        pos += need


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of ``step``: a function of the step alone, so a run resumed from a checkpoint makes the
    same random draws (dropout) as one that never stopped, with no RNG state in the checkpoint."""
    return (seed * 1_000_003 + step + 1) % 2**63


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def run(args) -> int:
    import fxpar
    from fxpar import checkpoint
    from fxpar.launch import init_distributed
    from fxpar.runtime.liveness import guard

    rank, world, device = init_distributed()
    plan = fxpar.Plan.from_file(args.plan_file) if args.plan_file else fxpar.Plan.parse(args.plan)
    say = print if rank == 0 else (lambda *a, **k: None)
    resume = checkpoint.latest(args.resume) if args.resume else None
    start = 0
    weights = None
    meta = args.meta or resume is not None
    torch.manual_seed(args.seed)
    model = load_model(args.model, meta=meta)
    if resume is not None:
        weights = checkpoint.model_source(resume)  # each rank reads only its own shards
        start = checkpoint.info(resume)["step"]
        say(f"resuming from {resume} (step {start})")
    elif meta:
        weights = "init"
    vocab = model.config.vocab_size
    data = batches(args.data, vocab, args.batch, args.seq, args.seed)
    for _ in range(start):  # the same data order as an uninterrupted run
        next(data)
    ids = next(data)
    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    lr = args.lr
    compiled = fxpar.compile(model, plan, example_kwargs=batch, device=device, weights=weights,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr), max_grad_norm=args.max_grad_norm)
    if resume is not None and compiled.optimizer is not None:
        try:  # optimizer states are saved by FQN: they reshard to any plan as the weights do
            checkpoint.load_optimizer(compiled, resume)
        except PlanError as e:  # a checkpoint of an older format, saved under another plan
            say(f"{e}: weights loaded, the optimizer state starts afresh")
    say(f"plan: {plan}  world {world}  device {device}")
    if rank == 0:
        report = fxpar.inspect(compiled, quiet=True)
        say(report.stage_table())
    losses = []
    for step in range(start, args.steps):
        if step > start:
            ids = next(data)
            batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
        torch.manual_seed(step_seed(args.seed, step))  # dropout draws the same masks in a resumed run
        t0 = time.perf_counter()
        loss = compiled.step(**batch).item()
        dt = time.perf_counter() - t0
        losses.append(loss)
        mem = sum(compiled.memory()["measured"].values()) / 2**20
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            norm = compiled.last_grad_norm
            say(f"{_bar(step + 1, args.steps)} step {step + 1}/{args.steps}  loss {loss:.4f}  "
                + (f"grad norm {norm:.4f}  " if norm is not None else "")
                + f"{ids.numel() / dt:,.0f} tok/s  mem/rank {mem:.1f} MiB", flush=True)
        if args.save and args.save_every and (step + 1) % args.save_every == 0:
            with guard("saving a checkpoint"):  # a peer lost during the save is named
                path = checkpoint.save(compiled, args.save, step + 1)
            say(f"saved {path}")
    if args.export:
        checkpoint.export_hf(compiled, args.export)
        say(f"exported {args.export} (from_pretrained loads it)")
    if args.losses_out and rank == 0:
        Path(args.losses_out).write_text("\n".join(f"{x!r}" for x in losses) + "\n")
    return 0


def add_arguments(p) -> None:
    p.add_argument("model", help="zoo name (see `fxpar zoo`) or path to a Hugging Face config.json")
    p.add_argument("--plan", default="dp=1", help="degrees and options, e.g. dp=2,pp=2,tp=2,zero=1,microbatches=4")
    p.add_argument("--plan-file", default=None, help="a JSON or TOML plan (never pickle)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step, over all replicas)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-grad-norm", type=float, default=None,
                   help="clip the global gradient norm (every TP/PP/ZeRO shard counted once) to this; the "
                        "norm before clipping is logged ('inf': log it without clipping)")
    p.add_argument("--data", default="synthetic", help="'synthetic' or a text file (bytes as tokens)")
    p.add_argument("--meta", action="store_true", help="build on the meta device; weights from the initialiser")
    p.add_argument("--save", default=None, help="checkpoint directory")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", default=None, help="continue from the last checkpoint in this directory")
    p.add_argument("--export", default=None, help="write a Hugging Face model (config + safetensors) here")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--losses-out", default=None, help="write every step's loss here (rank 0)")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="train_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
