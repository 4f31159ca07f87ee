"""fxpar's automatic pipeline split against torch.distributed.pipelining with an even-layers split.

    python bench/pipeline_vs_torch.py [--steps 10] [--warmup 2] [--schedule 1f1b|gpipe|both]
                                      [--write docs/benchmarks.md]

Same processes (2 gloo ranks, pp=2), same model (a small Llama built from ``LlamaConfig`` with a
fixed seed on every rank), same data (batch 8 x seq 128, 4 microbatches), same schedule, same AdamW.

* fxpar: ``fxpar.compile`` of the unmodified ``LlamaForCausalLM`` with labels; the cut is chosen by
  fxpar's cost model.
* torch: torchtitan-style manual split, ``split_spec={"model.layers.<layers/2>": SplitPoint.BEGINNING}``
  through ``torch.distributed.pipelining.pipeline`` (traced under ``torch.no_grad()``: without it the
  transformers 5.x Llama fails at run time), ``pipe.build_stage``, ``Schedule1F1B``/``ScheduleGPipe``
  with HF's shifted cross entropy as ``loss_fn``. ``pipeline()`` takes positional inputs only, so it
  runs a thin wrapper (``input_ids -> logits``) that holds the HF model's own ``model`` and
  ``lm_head`` (parameter names unchanged). Each torch step also broadcasts the loss from the last
  stage, as ``fxpar``'s ``step`` does, so both return the batch loss on every rank.

The two are built from fresh models with the same seed, so their first-step losses must agree
(checked, to ~1e-5) and, both training the same batch, so must the later ones. Timed steps
alternate between the two (fxpar then torch, then torch then fxpar, ...) after the warm-up steps, each between
barriers; the table gives the median per-step wall time on rank 0 and the ratio fxpar / torch.
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
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from _docs import replace_section  # bench/_docs.py (the script's folder is on sys.path)

from fxpar.testing.timing import timed

MODEL_CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=False)
SEED = 0
LR = 1e-3
LOSS_TOL = 1e-4


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**MODEL_CONFIG)


def _build_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(_config())
    model.train()
    return model


def _batch(batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (batch, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


class LogitsOnly(torch.nn.Module):
    """``input_ids -> logits`` around a HF causal LM's ``model`` and ``lm_head`` (same parameter FQNs)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.model = hf.model
        self.lm_head = hf.lm_head

    def forward(self, input_ids):
        hidden = self.model(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.lm_head(hidden)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's ForCausalLMLoss without num_items_in_batch: labels shifted left, -100 padded, mean CE."""
    logits = logits.float()
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1).to(logits.device),
                           ignore_index=-100, reduction="mean")


# ---- the two contenders, one step each ------------------------------------------------------------------
class FxparRunner:
    def __init__(self, schedule: str, batch: dict, microbatches: int):
        import fxpar
        from fxpar.cost import partition as P

        self.batch = {**batch, "use_cache": False}  # the unmodified model, called as HF users train it
        model = _build_model()
        plan = fxpar.Plan(pp=2, microbatches=microbatches, schedule=schedule)
        t0 = time.perf_counter()
        self.compiled = fxpar.compile(model, plan, example_kwargs=self.batch, optimizer=_adamw)
        self.compile_s = time.perf_counter() - t0
        layers = MODEL_CONFIG["num_hidden_layers"]
        even = [(f"model.layers.{layers // 2}", "beginning")]
        program = self.compiled.program
        self.cuts = list(self.compiled.cuts)
        self.balance = {"fxpar": P.balance(P.stage_costs(program, self.cuts)),
                        "even": P.balance(P.stage_costs(program, even))}
        self.stage_table = fxpar.inspect(self.compiled, quiet=True).stage_table()

    def step(self) -> float:
        return self.compiled.step(**self.batch).item()


class TorchRunner:
    def __init__(self, schedule: str, batch: dict, microbatches: int, model: torch.nn.Module | None = None):
        """``model``: the HF causal LM to split (default: a fresh one of ``MODEL_CONFIG``)."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.batch, self.m = batch, microbatches
        model = _build_model() if model is None else model
        wrapper = LogitsOnly(model)  # fresh: pipeline() patches the split module in place
        mb_ids = batch["input_ids"].chunk(microbatches)[0]
        k = model.config.num_hidden_layers // 2
        t0 = time.perf_counter()
        with torch.no_grad():  # transformers 5.x Llama fails at run time when traced with grad on
            pipe = pipeline(wrapper, mb_args=(mb_ids,), split_spec={f"model.layers.{k}": SplitPoint.BEGINNING})
        self.stage = pipe.build_stage(self.rank, torch.device("cpu"))
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = cls(self.stage, n_microbatches=microbatches, loss_fn=causal_lm_loss)
        self.optimizer = _adamw(self.stage.submod.parameters())
        self.build_s = time.perf_counter() - t0

    def step(self) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        first, last = self.rank == 0, self.rank == self.world - 1
        losses: list = []
        args = (self.batch["input_ids"],) if first else ()
        kwargs = {"target": self.batch["labels"], "losses": losses} if last else {}
        self.schedule.step(*args, **kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if last else torch.zeros(())
        dist.broadcast(loss, src=self.world - 1)  # the batch loss on every rank, as fxpar's step
        self.optimizer.step()
        return loss.item()


def bench_rank(schedule: str, steps: int, warmup: int, batch_size: int, seq: int, microbatches: int) -> dict:
    """On every rank: build both, check the first losses agree, then time alternating steps."""
    torch.set_num_threads(1)
    batch = _batch(batch_size, seq)
    fx = FxparRunner(schedule, batch, microbatches)
    th = TorchRunner(schedule, batch, microbatches)
    fx_losses, th_losses, fx_times, th_times = [], [], [], []
    pair = ((fx, fx_times, fx_losses), (th, th_times, th_losses))
    for i in range(warmup + steps):
        for runner, times, losses in (pair if i % 2 == 0 else pair[::-1]):  # neither always goes first
            dt, loss = timed(runner.step)
            losses.append(loss)
            if i >= warmup:
                times.append(dt)
    return {"rank": dist.get_rank(), "fx_times": fx_times, "th_times": th_times, "fx_losses": fx_losses,
            "th_losses": th_losses, "cuts": fx.cuts, "balance": fx.balance, "stage_table": fx.stage_table,
            "fx_compile_s": fx.compile_s, "th_build_s": th.build_s}


# ---- reporting ------------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def summarize(schedule: str, results: list[dict]) -> dict:
    r0 = results[0]
    fx_med = statistics.median(r0["fx_times"])
    th_med = statistics.median(r0["th_times"])
    diffs = [abs(a - b) for a, b in zip(r0["fx_losses"], r0["th_losses"])]
    return {"schedule": schedule, "fx_med": fx_med, "th_med": th_med, "ratio": fx_med / th_med,
            "fx_best": min(r0["fx_times"]), "th_best": min(r0["th_times"]),
            "fx_times": r0["fx_times"], "th_times": r0["th_times"], "fx_losses": r0["fx_losses"],
            "th_losses": r0["th_losses"], "first_diff": diffs[0], "max_diff": max(diffs), "cuts": r0["cuts"],
            "balance": r0["balance"], "stage_table": r0["stage_table"], "fx_compile_s": r0["fx_compile_s"],
            "th_build_s": r0["th_build_s"]}


def print_summary(s: dict) -> None:
    print(f"\n=== schedule {s['schedule']} ===")
    print(s["stage_table"])
    print(f"fxpar cuts: {s['cuts']}   (torch: [('model.layers.{MODEL_CONFIG['num_hidden_layers'] // 2}', "
          f"'beginning')])")
    print(f"predicted balance (max/mean of stage fwd+bwd+transfer): fxpar {s['balance']['fxpar']:.3f}, "
          f"even layers {s['balance']['even']:.3f}")
    print(f"build: fxpar compile {s['fx_compile_s']:.1f} s, torch pipeline+stage {s['th_build_s']:.1f} s")
    print("losses per step (fxpar / torch): " + ", ".join(
        f"{a:.6f}/{b:.6f}" for a, b in zip(s["fx_losses"], s["th_losses"])))
    print(f"first-step |dloss| {s['first_diff']:.2e}, worst over all steps {s['max_diff']:.2e}")
    print(f"step times ms  fxpar: {', '.join(_ms(t) for t in s['fx_times'])}")
    print(f"step times ms  torch: {', '.join(_ms(t) for t in s['th_times'])}")
    print(f"median step: fxpar {_ms(s['fx_med'])} ms, torch {_ms(s['th_med'])} ms, ratio fxpar/torch "
          f"{s['ratio']:.3f}  (best: fxpar {_ms(s['fx_best'])} ms, torch {_ms(s['th_best'])} ms, ratio "
          f"{s['fx_best'] / s['th_best']:.3f})")


SECTION = "### fxpar vs torch.distributed.pipelining, pp=2"


def markdown(summaries: list[dict], a, load: tuple[float, float]) -> str:
    c = MODEL_CONFIG
    now = datetime.date.today().isoformat()
    mach = f"{platform.machine()} {os.cpu_count()} threads, {platform.system()} {platform.release()}"
    lines = [f"\n{SECTION}\n",
             f"{now}, {mach}, torch {torch.__version__}, transformers {transformers.__version__}. "
             f"Llama from LlamaConfig (hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
             f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads, intermediate "
             f"{c['intermediate_size']}, vocab {c['vocab_size']}, untied), fp32 on CPU, batch {a.batch} x seq "
             f"{a.seq}, {a.microbatches} microbatches, AdamW lr {LR}; 2 gloo ranks, one torch thread each, in "
             f"the same processes; {a.warmup} warm-up steps then {a.steps} timed steps of each, interleaved, "
             f"barrier-to-barrier on rank 0 (`bench/pipeline_vs_torch.py`). fxpar cuts automatically; torch "
             f"uses torchtitan's even split `model.layers.{c['num_hidden_layers'] // 2}` BEGINNING. 1-minute load "
             f"average {load[0]:.1f} before, {load[1]:.1f} after (other jobs shared the 2 cores).\n",
             "| schedule | fxpar cut | predicted balance fxpar / even | fxpar median ms | torch median ms "
             "| fxpar/torch | best ms fxpar / torch | loss step 1 fxpar / torch | worst \\|dloss\\| |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        cut = ", ".join(m for m, _ in s["cuts"])
        lines.append(f"| {s['schedule']} | {cut} | {s['balance']['fxpar']:.3f} / {s['balance']['even']:.3f} | "
                     f"{_ms(s['fx_med'])} | {_ms(s['th_med'])} | {s['ratio']:.3f} | "
                     f"{_ms(s['fx_best'])} / {_ms(s['th_best'])} | "
                     f"{s['fx_losses'][0]:.6f} / {s['th_losses'][0]:.6f} | {s['max_diff']:.1e} |")
    lines.append("")
    for s in summaries:
        lines.append(f"- {s['schedule']} step times (ms), fxpar: {', '.join(_ms(t) for t in s['fx_times'])}; "
                     f"torch: {', '.join(_ms(t) for t in s['th_times'])}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each, after the warm-up")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedule", choices=("1f1b", "gpipe", "both"), default="both")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--write", default=None, help="replace this benchmark's section of this markdown file")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    from fxpar.testing.multiproc import RankPool

    schedules = ["1f1b", "gpipe"] if a.schedule == "both" else [a.schedule]
    summaries = []
    load_before = os.getloadavg()[0]
    with RankPool(2) as pool:
        for schedule in schedules:
            results = pool.run(bench_rank, schedule, a.steps, a.warmup, a.batch, a.seq, a.microbatches,
                               timeout=600)
            s = summarize(schedule, results)
            print_summary(s)
            summaries.append(s)
    bad = [s["schedule"] for s in summaries if s["first_diff"] > LOSS_TOL]
    if bad:
        print(f"\nWARNING: first-step losses differ by more than {LOSS_TOL} for {bad}: the comparison is not fair")
    if a.write:
        replace_section(a.write, SECTION, markdown(summaries, a, (load_before, os.getloadavg()[0])))
        print(f"\nwrote its section of {a.write}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()
