"""Fitting a calibrated profile's matmul rate to one measured training step of a reference transformer
(``fxpar calibrate --reference``; off by default).

Square matmuls can overrate what a training step gets (thin and transposed operands). With ``--reference``,
``fxpar calibrate`` also times the forward and backward of a small Llama-shaped model (:data:`REFERENCE`,
built from a config, no download) on this process, splits the time with ``torch.profiler`` into matrix
products (``mm``, ``addmm``, ``bmm``, attention) and everything else, prices the same step with
:func:`~fxpar.planner.model_costs.model_costs` on the micro-benchmarked profile, and scales the profile's
matmul rate so that the matrix products match the measurement (their outputs' first touch apart). The rest
of the step is compared and reported, not fitted: it is dominated by the loss's internal buffers
(``nll_loss``'s backward fills a logits-sized gradient no graph node shows), and scaling the elementwise
rate to absorb it made models with other mixes 31% slower than measured (``bench/planner_accuracy.py``,
GPT-2). The fit is off by default because one 1.1 s step moved the matmul rate by -7% to +12% between runs
on the 2-core CI host, more than it corrected there; the training-shaped matmuls of
:mod:`fxpar.runtime.calibrate_step` are the default. The reference model is fixed (never one of the
models being planned), so the fit is a property of the machine.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from fxpar.cost.roofline import work_terms
from fxpar.ir.op_classes import MATMUL_KERNELS

# a small decoder of ordinary proportions: 8 heads of 64, GQA 2:1, SwiGLU MLP of 2.7x, a 16K vocabulary
REFERENCE = dict(vocab_size=16384, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                 tie_word_embeddings=False)
BATCH, SEQ = 4, 256

__all__ = ["REFERENCE", "fit_to_reference", "reference_step"]


def _model():
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**REFERENCE))
    ids = torch.randint(0, REFERENCE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return model.train(), {"input_ids": ids, "labels": ids, "use_cache": False}


def reference_step(steps: int = 3) -> dict:
    """Seconds of one forward + backward of the reference model on this process: ``{"step": wall seconds
    (median of ``steps``), "matmul": seconds in matrix products and attention (profiled)}``."""
    model, kw = _model()

    def step():
        model(**kw).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    products = {f"aten::{op.__name__}" for op in MATMUL_KERNELS}  # the profiler's event names
    mm = sum(e.self_cpu_time_total for e in prof.key_averages()
             if e.key in products or "scaled_dot_product" in e.key) / 1e6 / steps
    return {"step": sorted(walls)[len(walls) // 2], "matmul": mm}


def _predicted(profile, costs) -> dict:
    """The reference step priced as :meth:`~fxpar.planner.model_costs.RankPart.time` prices it, in parts
    (:func:`fxpar.cost.roofline.work_terms`): matrix products, elementwise ops, first touch of new outputs
    (of each), and op launches."""
    got = dict.fromkeys(("matmul", "elementwise", "fresh_matmul", "fresh_elementwise", "overhead"), 0.0)
    for name in ["pre", *costs.layers, "post"]:
        for f, b, act, weight, *out in costs.part(name, 1, False).nodes:
            terms = work_terms(profile, f * BATCH, b * BATCH, act * BATCH + weight, out[0] * BATCH if out else 0.0,
                               costs.dtype)
            for k, t in terms.items():
                got[k] += t
    return got


def fit_to_reference(profile, measured: dict | None = None):
    """``(profile, figures)``: ``profile`` with its matmul rates scaled by the reference step's measured
    over predicted matrix-product time, and its elementwise rate and memory bandwidth by the same ratio for
    the rest of the step (its op overheads taken out first); ``figures`` says what was measured and fitted."""
    from fxpar.planner.model_costs import model_costs

    measured = measured or reference_step()
    model, _ = _model()
    costs = model_costs(model, SEQ, tp_degrees=(1,), sequence_parallel=(False,))
    pred = _predicted(profile, costs)
    mm, ew = pred["matmul"], pred["elementwise"]
    mm_left = measured["matmul"] - pred["fresh_matmul"]  # the products' own time, their outputs' first touch apart
    other = measured["step"] - measured["matmul"] - pred["overhead"] - pred["fresh_elementwise"]
    r_mm = mm / mm_left if mm_left > 0 else 1.0
    r_ew = ew / other if other > 0 and ew > 0 else 1.0  # reported, not applied (see the module's docstring)
    fitted = dataclasses.replace(
        profile, flops={k: v * r_mm for k, v in profile.flops.items()},
        source=profile.source + f"; matmul rate fitted to a reference step (x{r_mm:.2f})")
    figures = {"model": {**REFERENCE, "batch": BATCH, "seq": SEQ}, "measured": measured,
               "predicted": pred,
               "matmul_factor": r_mm, "elementwise_factor": r_ew}
    return fitted, figures
