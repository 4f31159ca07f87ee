"""Single-process fine-tuning references for ``fxpar train``: a plain PyTorch loop and HF's Trainer.

Both read the model directory with ``from_pretrained``, take the data in the order ``fxpar train`` takes
it (:class:`fxpar.data.Batches` with the same seed: ``accum`` batches of ``batch`` rows per optimizer
step), and optimise as Trainer does: torch AdamW with Trainer's weight-decay groups
(``Trainer.get_decay_parameter_names``), ``transformers.get_scheduler``, the loss of an accumulated step
averaged over all its label tokens (``num_items_in_batch``), ``clip_grad_norm_`` before the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Recipe:
    """What a fine-tuning run is, shared by fxpar's command line and the references."""
    model_dir: str
    data: str
    steps: int = 20
    batch: int = 4
    accum: int = 2
    seq: int = 64
    lr: float = 2e-3
    scheduler: str = "cosine"
    warmup: int = 3
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    pack: bool = True
    eval_data: str | None = None

    def argv(self, plan: str) -> list[str]:
        """``fxpar train`` arguments for this recipe under ``plan``."""
        out = [self.model_dir, "--plan", plan, "--data", self.data, "--steps", str(self.steps), "--batch",
               str(self.batch), "--grad-accum", str(self.accum), "--seq", str(self.seq), "--lr", str(self.lr),
               "--lr-scheduler", self.scheduler, "--warmup", str(self.warmup), "--weight-decay",
               str(self.weight_decay), "--max-grad-norm", str(self.max_grad_norm), "--seed", str(self.seed)]
        out += ["--eval-data", self.eval_data, "--eval-every", "-1"] if self.eval_data else []
        return out + ([] if self.pack else ["--no-pack"])

    def dataset(self, model, path: str | None = None):
        import inspect

        from fxpar.data import DataSpec, TokenDataset, load_tokenizer

        tok = load_tokenizer(self.model_dir)
        spec = DataSpec(path or self.data, seq=self.seq, pack=self.pack)
        return TokenDataset(spec, tok, max_positions=model.config.max_position_embeddings,
                            position_ids="position_ids" in inspect.signature(model.forward).parameters)

    def decay_names(self, model) -> set[str]:
        from transformers import Trainer

        # Trainer.get_decay_parameter_names reads nothing of the trainer but the model
        return set(Trainer.get_decay_parameter_names(None, model)) if self.weight_decay else set()


@torch.no_grad()
def evaluate(model, dataset, batch: int) -> float:
    """Mean loss over every label token of ``dataset`` (each sample once)."""
    from fxpar.data import eval_batches

    total, count = 0.0, 0
    for b in eval_batches(dataset, batch):
        n = int((b["labels"][..., 1:] != -100).sum())
        if n:
            total += model(**b, use_cache=False).loss.item() * n
            count += n
    return total / count


def reference_losses(recipe: Recipe) -> dict[str, list[float]]:
    """The plain loop: per optimizer step, the loss (mean over the step's label tokens) and the global
    gradient norm before clipping; with ``eval_data``, the evaluation loss before and after."""
    from transformers import AutoModelForCausalLM, get_scheduler

    from fxpar.data import Batches

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(recipe.model_dir, dtype=torch.float32).train()
    batches = Batches(recipe.dataset(model), batch=recipe.batch, seed=recipe.seed)
    decay = recipe.decay_names(model)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": recipe.weight_decay},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.999), eps=1e-8)
    sched = get_scheduler(recipe.scheduler, opt, num_warmup_steps=recipe.warmup, num_training_steps=recipe.steps)
    losses, norms, evals = [], [], []
    held_out = recipe.dataset(model, recipe.eval_data) if recipe.eval_data else None
    if held_out is not None:
        evals.append(evaluate(model, held_out, recipe.batch * recipe.accum))
    for _ in range(recipe.steps):
        parts = [dict(next(batches)) for _ in range(recipe.accum)]
        items = sum(int((p["labels"][..., 1:] != -100).sum()) for p in parts)
        opt.zero_grad()
        total = 0.0
        for p in parts:
            out = model(**p, use_cache=False, num_items_in_batch=items)
            out.loss.backward()
            total += out.loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm).item())
        opt.step()
        sched.step()
        losses.append(total)
    if held_out is not None:
        evals.append(evaluate(model, held_out, recipe.batch * recipe.accum))
    return {"losses": losses, "norms": norms, "evals": evals}


def trainer_losses(recipe: Recipe, output_dir: str) -> list[float]:
    """The same run through HF ``Trainer``: its sampler replaced by one that reads the rows in fxpar's order
    (the only change), everything else Trainer's own (grouping, AdamW, schedule, accumulation with
    ``num_items_in_batch``, clipping). Per optimizer step, the loss Trainer logs."""
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from fxpar.data import Batches

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(recipe.model_dir, dtype=torch.float32)
    model.config.use_cache = False
    batches = Batches(recipe.dataset(model), batch=recipe.batch, seed=recipe.seed)
    rows = []
    for _ in range(recipe.steps * recipe.accum):
        b = next(batches)
        rows += [{k: v[i] for k, v in b.items()} for i in range(recipe.batch)]

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    logged = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=recipe.batch,
                             gradient_accumulation_steps=recipe.accum, max_steps=recipe.steps,
                             learning_rate=recipe.lr, lr_scheduler_type=recipe.scheduler,
                             warmup_steps=recipe.warmup, weight_decay=recipe.weight_decay,
                             max_grad_norm=recipe.max_grad_norm, optim="adamw_torch", logging_steps=1,
                             report_to=[], save_strategy="no", seed=recipe.seed, use_cpu=True,
                             dataloader_drop_last=True, remove_unused_columns=False, disable_tqdm=True)
    InOrder(model=model, args=args, train_dataset=rows, callbacks=[Losses()]).train()
    return logged
