"""The fine-tuning loop behind ``fxpar train`` and ``examples/finetune_hf.py`` (run under torchrun).

Every rank builds the model (a ``save_pretrained`` directory: on the meta device, each rank reading only
its own shards of the safetensors files; or a zoo name / config.json), the tokenizer (from the model
directory, or ``--tokenizer``) and the data (:mod:`fxpar.train.streams`), compiles the model for the
plan with AdamW (Trainer's weight-decay groups), the learning-rate schedule and the gradient-norm
clipping, and trains: each step one global batch of ``accum x batch`` sequences. Rank 0 prints a
progress line; every rank takes part in the JSON-lines metrics and the evaluations
(``--eval-data``, ``--eval-every``: loss and perplexity over every evaluation sample once, whatever
the data-parallel degree).

Everything is checked before the first collective (the model directory, the tokenizer, the data files and
their fields (of a streamed file, its first rows), the chat template, the sequence length against the
model's maximum, the plan), so bad input is one clear error on every rank, not a hang.

Nothing is chosen silently: ``--data`` has no default (``--data synthetic`` trains on random tokens and
says so in a banner, and again when it exports); what a run resumes from, and at which step, is printed;
saving and resuming follow :mod:`fxpar.train.saving` (``--save`` alone saves at the end). Resuming
reproduces the uninterrupted run: weights and optimizer states come from the checkpoint (each rank reads
its own shards, under any plan), the schedule's state, the data position and the tokens seen from its
``extra`` record, and every step seeds the RNG from ``(--seed, step)``. The progress line and the
metrics records: :mod:`fxpar.train.progress`. ``--lora``: the model wrapped by PEFT before it is compiled, only
the adapters trained and exported (:mod:`fxpar.train.lora`, :mod:`fxpar.adapters`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import torch

from fxpar.ir.batch import counted_labels
from fxpar.ir.errors import PlanError
from fxpar.ir.schedule import microbatches
from fxpar.planner.auto import compute_dtype
from fxpar.train import lora, optim, saving, streams
from fxpar.train import metrics as M
from fxpar.train.config import FineTuneConfig
from fxpar.train.progress import Progress

SYNTHETIC = ("data: synthetic: this run trains on random tokens (--data synthetic), not on any data of yours; "
             "give --data FILE to fine-tune on a file")
NO_DATA = ("no --data given: give --data FILE (plain text, JSON lines, chat JSON lines or parquet) to train on "
           "it, or --data synthetic to train on random tokens (benchmarks, smoke tests)")


def step_seed(seed: int, step: int) -> int:
    """The RNG seed of ``step``: a function of the step alone, so a resumed run draws what an uninterrupted
    one draws (dropout) with no RNG state in the checkpoint."""
    return (seed * 1_000_003 + step + 1) % 2**63


def check_args(a) -> None:
    """The options of the loop itself, before anything is read (the data and the model: further on)."""
    if not getattr(a, "data", None):
        raise PlanError(NO_DATA)
    if a.steps < 0:
        raise PlanError(f"--steps {a.steps}: give 0 or more optimizer steps")
    if a.log_every < 1:
        raise PlanError(f"--log-every {a.log_every}: give 1 or more steps between progress lines")
    if a.grad_accum < 1:
        raise PlanError(f"--grad-accum {a.grad_accum}: give 1 or more batches per optimizer step")
    for flag, value in (("--batch", a.batch), ("--seq", a.seq)):
        if value < 1:
            raise PlanError(f"{flag} {value}: give 1 or more")
    for flag, value in (("--lr", a.lr), ("--weight-decay", a.weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise PlanError(f"{flag} {value}: give a finite number, 0 or more")
    if a.max_grad_norm is not None and not (a.max_grad_norm > 0):  # 'inf' is allowed: log without clipping
        raise PlanError(f"--max-grad-norm {a.max_grad_norm}: give a positive norm ('inf': log it without clipping)")
    saving.check_options(a)
    lora.check_options(a)


def given_plan(a):
    """The plan of ``--plan`` / ``--plan-file`` with ``--bf16`` and ``--grad-accum`` applied."""
    from fxpar.ir.plan import Plan

    plan = Plan.from_file(a.plan_file) if a.plan_file else Plan.parse(a.plan)
    if a.bf16:
        plan = dataclasses.replace(plan, mixed_precision="bf16")
    if a.grad_accum > 1:  # accumulation: more microbatches of the same size (fxpar.train.streams)
        plan = dataclasses.replace(plan, microbatches=microbatches(plan) * a.grad_accum)
    return plan


def source(a, model, directory, resume, adapters: dict):
    """What ``compile(..., weights=)`` reads: the checkpoint resumed from, the model directory (with ``--lora``:
    the adapters' first values beside it), the initialiser (``--meta``), or None (the model's own tensors)."""
    from fxpar import checkpoint
    from fxpar.adapters import AdapterWeights
    from fxpar.train.models import directory_weights

    if resume is not None:
        reader = checkpoint.model_source(resume)  # each rank reads only its own shards
        lora.check_checkpoint(a, model, reader)
        return reader
    files = directory_weights(directory) if directory is not None else None
    if a.lora and (directory is not None or a.meta):  # the adapters as PEFT made them, the base from the files
        return AdapterWeights(model, files, adapters)
    return files if files is not None else "init" if a.meta else None


def export(compiled, a, tokenizer, rank: int) -> str:
    """``--export``: the model as ``save_pretrained`` writes it (with ``--lora``: the adapter as PEFT writes it,
    ``--merge``: the merged model too) and the tokenizer; every rank calls it. Returns the line to print."""
    from fxpar import checkpoint
    from fxpar.adapters import export_adapter

    if a.lora:
        export_adapter(compiled, a.export, merge=a.merge)
    else:
        checkpoint.export_hf(compiled, a.export)
    if tokenizer is not None and rank == 0:
        tokenizer.save_pretrained(a.export)
    loads = "PeftModel.from_pretrained(base, DIR) loads it" if a.lora and not a.merge else \
        "from_pretrained loads it" + (f"; the adapter: {Path(a.export) / 'adapter'}" if a.lora else "")
    return f"exported {a.export} ({loads})" + (
        "; its weights were trained on random tokens (--data synthetic), not on any data" if
        a.data == "synthetic" else "")


class FineTune:
    """One run's state: model, data, compiled program, schedule, metrics. ``run()`` trains. Built from a
    :class:`FineTuneConfig`, its fields as keywords or a parsed command line (:meth:`FineTuneConfig.of`)."""

    def __init__(self, config: FineTuneConfig | None = None, **options):
        import fxpar
        from fxpar import checkpoint
        from fxpar.launch import check_launch_world, init_distributed
        from fxpar.train.models import load_model, model_directory

        self.config = a = FineTuneConfig.of(config, **options)
        self.accum = a.grad_accum
        check_args(a)
        optim.check_schedule(a.lr_scheduler, a.warmup, a.steps)
        auto = not a.plan_file and a.plan.strip().lower() == "auto"  # chosen below, once the batch is known
        self.plan = plan = None if auto else given_plan(a)
        directory = model_directory(a.model)
        self.resume, self.resume_note = saving.resume_point(a)
        saving.check_outputs(a)  # (after resume_point: it creates --save)
        self.start, extra = 0, {}
        if self.resume is not None:
            info = checkpoint.info(self.resume)
            self.start, extra = info["step"], info.get("extra") or {}
            if self.start > a.steps:
                raise PlanError(f"--resume {self.resume} is at step {self.start}, past --steps {a.steps}: "
                                f"give --steps {self.start} or more (the total, the steps done included)")
        torch.manual_seed(a.seed)
        model = load_model(a.model, meta=a.meta or self.resume is not None)
        # --lora: PEFT's wrapping, its adapters' first values made on the CPU (every rank alike: seeded above)
        model, adapters = lora.wrap(model, a, directory and str(directory)) if a.lora else (model, {})
        self.model = model
        weights = source(a, model, directory, self.resume, adapters)
        self.tokenizer = None
        tok_dir = a.tokenizer or directory
        if tok_dir is not None and a.data != "synthetic":
            from fxpar.data import load_tokenizer

            self.tokenizer = load_tokenizer(tok_dir)
        self.stream = self._stream(a.data, a.batch)
        self.eval_data = self._dataset(a.eval_data) if a.eval_data else None
        if a.eval_data and a.eval_every <= 0 and a.eval_every != -1:
            raise PlanError(f"--eval-every {a.eval_every}: give a positive number of steps "
                            "(-1: at the start and the end only)")
        check_launch_world(plan)
        self.rank, self.world, self.device = init_distributed()  # the first step that talks to peers
        if self.resume is not None or self.resume_note:
            self.say(f"resuming from {self.resume} (step {self.start})" if self.resume else self.resume_note)
        if "data" in extra:
            self.stream.load_state_dict(extra["data"])
        else:  # a checkpoint without a data position: the batches of the steps taken are skipped
            for _ in range(self.start * self.accum):
                self.stream.next_batch()
        self.data_start = self.stream.state_dict()  # where this run's data begins (saved, for a resumed one)
        self.batch = streams.step_batch(self.stream, self.accum)
        if auto:  # the planner prices the whole step's batch (its microbatches cover the accumulation)
            from fxpar.planner.auto import explain, plan_for_compile

            chosen = plan_for_compile(model, (), self.batch, world=self.world, device=self.device,
                                      optimizer=optim.adamw_factory(a.lr, a.weight_decay), frontend="auto",
                                      dtype="bf16" if a.bf16 else None)  # as `fxpar plan --auto --dtype bf16`
            self.say(explain(chosen))
            plan = chosen.best
            self.plan = plan = dataclasses.replace(plan, mixed_precision="bf16") if a.bf16 else plan
        self.compiled = fxpar.compile(model, plan, example_kwargs=self.batch, device=self.device, weights=weights,
                                      optimizer=optim.adamw_factory(a.lr, a.weight_decay),
                                      param_groups=optim.param_groups_rule(a.weight_decay),
                                      max_grad_norm=a.max_grad_norm)
        if self.resume is not None and self.compiled.optimizer is not None:
            try:  # optimizer states are saved by FQN: they reshard to any plan as the weights do
                checkpoint.load_optimizer(self.compiled, self.resume)
            except PlanError as e:  # a checkpoint of an older format, saved under another plan
                self.say(f"{e}: weights loaded, the optimizer state starts afresh")
        total = a.steps
        self.scheduler = optim.make_scheduler(self.compiled.optimizer, a.lr_scheduler,
                                              optim.warmup_steps(a.warmup, total), total, a.lr)
        if "scheduler" in extra:  # (building the schedule set the warm-up's first rate: the saved step's goes in)
            optim.load_schedule(self.scheduler, extra["scheduler"])
        self.log = M.MetricsLog(a.metrics_out, a.tensorboard, self.rank)
        self.saver = saving.Saver(a, self.rank)
        # tokens seen before this run: saved with the checkpoint (older ones: every step's full batch)
        seen = extra.get("tokens_seen", self.start * self.accum * a.batch * a.seq)
        self.progress = Progress(self.start, a.steps, int(seen))
        self.flops = M.step_flops(self.compiled.program)
        # MFU against the device profile's peak in the dtype the step computes in (as the planner's)
        self.mfu_profile = M.device_profile(self.device)
        self.mfu_dtype = compute_dtype(model, self.compiled.plan)
        self.losses: list[float] = []
        self.evals: list[dict] = []

    # ---- data ----------------------------------------------------------------------------------------
    def _dataset(self, path: str):
        return streams.file_dataset(path, self.config, self.tokenizer, self.model)

    def _stream(self, data: str, batch: int):
        a = self.config
        if data == "synthetic":
            return streams.SyntheticStream(self.model.config.vocab_size, batch, a.seq, a.seed)
        if not Path(data).is_file():
            raise PlanError(f"--data {data}: no such file ('synthetic' for random tokens)")
        if self.tokenizer is None:  # a model without a tokenizer: the file's bytes are the tokens
            return streams.ByteStream(data, self.model.config.vocab_size, batch, a.seq)
        return streams.TokenStream(self._dataset(data), batch, a.seed)

    # ---- running -------------------------------------------------------------------------------------
    def say(self, *parts, **kw) -> None:
        if getattr(self, "rank", 0) == 0:
            print(*parts, **kw)

    def train_step(self, step: int) -> float:

        if step > self.start:
            self.batch = streams.step_batch(self.stream, self.accum)
        lr = self.scheduler.get_last_lr()[0]
        torch.manual_seed(step_seed(self.config.seed, step))  # dropout draws the same masks in a resumed run
        t0 = time.perf_counter()
        loss = self.compiled.step(**self.batch).item()
        dt = time.perf_counter() - t0
        self.scheduler.step()
        self.losses.append(loss)
        a, norm = self.config, self.compiled.last_grad_norm
        tokens = self.batch["input_ids"].numel()
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / dt,
                  "step_s": dt, **self.progress.step(step + 1, tokens)}
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            epoch = self.stream.epoch()
            record.update({"mem_mib_per_rank": M.memory_per_rank(self.compiled),
                           "mfu": M.mfu(self.flops, dt, self.world, self.mfu_profile, self.mfu_dtype),
                           **({"epoch": epoch} if epoch is not None else {}),
                           **getattr(self.stream, "progress", dict)()})  # streamed data: what is read so far
            self.log.write(record)
            self.say(self.progress.line(record), flush=True)
        if self.saver.due(step + 1):
            extra = {"scheduler": self.scheduler.state_dict(), "data": self.stream.state_dict(),
                     "tokens_seen": self.progress.tokens}
            path, removed = self.saver.save(self.compiled, step + 1, extra)
            self.say(f"saved {path}" + (f" (removed {', '.join(p.name for p in removed)}: --save-total-limit "
                                        f"{a.save_total_limit})" if removed else ""), flush=True)
        return loss

    def evaluate(self, step: int) -> dict:
        """Loss over every evaluation sample once (label tokens weighted alike across batches) and its
        perplexity; the evaluation batches are global batches like training ones."""
        from fxpar.data import eval_batches

        total, count = 0.0, 0
        # the training step's global batch size: the evaluation runs the training program in inference
        for batch in eval_batches(self.eval_data, self.config.batch * self.accum):
            n = counted_labels(batch["labels"], self.model)
            if n == 0:
                continue
            out = self.compiled(**batch)
            total += float(out.loss) * n
            count += n
        loss = total / max(count, 1)
        record = {"step": step, "eval_loss": loss, "eval_ppl": M.perplexity(loss), "eval_tokens": count}
        self.log.write(record)
        self.evals.append(record)
        self.say(f"eval at step {step}: loss {loss:.4f}  perplexity {record['eval_ppl']:.3f}  ({count} tokens)",
                 flush=True)
        return record

    def run(self) -> list[float]:
        import fxpar

        a = self.config
        if a.data == "synthetic":
            self.say(SYNTHETIC, flush=True)
        self.say(f"plan: {self.plan}  world {self.world}  device {self.device}"
                 + (f"  accumulation {self.accum}" if self.accum > 1 else "") + streams.describe(self.stream))
        if self.rank == 0:
            self.say(fxpar.inspect(self.compiled, quiet=True).stage_table())
        if self.eval_data is not None and self.start == 0:
            self.evaluate(0)
        self.progress.began = time.perf_counter()  # elapsed and ETA count from here
        for step in range(self.start, a.steps):
            self.train_step(step)
            if self.eval_data is not None and a.eval_every > 0 and (step + 1) % a.eval_every == 0 \
                    and step + 1 != a.steps:
                self.evaluate(step + 1)
        if self.eval_data is not None and a.steps > self.start:
            self.evaluate(a.steps)
        if a.export:
            self.say(export(self.compiled, a, self.tokenizer, self.rank))
        if a.losses_out and self.rank == 0:
            Path(a.losses_out).write_text("\n".join(f"{x!r}" for x in self.losses) + "\n")
        self.log.close()
        return self.losses
