"""The progress of a fine-tuning run as HF Trainer and torchtitan users read it: rank 0's line and the
step's metrics record (``--metrics-out``), from the same numbers.

Each logged step: the step of the total, the loss, the learning rate, the gradient norm (when clipping
or logging it), tokens per second of the step, tokens seen so far (every sequence of every step's global
batch, padding included, as Trainer's ``num_input_tokens_seen``; resumed runs count on from the
checkpoint), the epoch as a fraction where the data's length is known (files; not random tokens), the
time since this run's training began and the estimated time left (h:mm:ss; the mean time of this run's
steps, evaluations and saves included, times the steps left), and memory per rank.
"""

from __future__ import annotations

import time


def hms(seconds: float) -> str:
    """``h:mm:ss`` as tqdm and Trainer print durations."""
    s = int(round(max(seconds, 0.0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def count(n: float) -> str:
    """A token count with a metric suffix: 960, 12.3K, 4.56M, 7.89G."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Progress:
    """The clock and the token count of one run from step ``start`` of ``total`` (``tokens``: those seen
    before ``start``, from the checkpoint)."""

    def __init__(self, start: int, total: int, tokens: int = 0):
        self.start, self.total, self.tokens = start, total, tokens
        self.began = time.perf_counter()

    def step(self, step: int, tokens: int) -> dict:
        """After step ``step`` (1-based) of ``tokens`` tokens: ``tokens_seen``, ``elapsed_s``, ``eta_s``."""
        self.tokens += tokens
        elapsed = time.perf_counter() - self.began
        done = step - self.start
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        return {"tokens_seen": self.tokens, "elapsed_s": elapsed, "eta_s": eta}

    def line(self, r: dict) -> str:
        """The progress line of the metrics record ``r`` (see the module docstring)."""
        mem = r["mem_mib_per_rank"]
        return (f"{bar(r['step'], self.total)} step {r['step']}/{self.total}  loss {r['loss']:.4f}  lr {r['lr']:.3g}  "
                + (f"grad norm {r['grad_norm']:.4f}  " if r.get("grad_norm") is not None else "")
                + f"{r['tokens_per_s']:,.0f} tok/s  tokens {count(r['tokens_seen'])}  "
                + (f"epoch {r['epoch']:.2f}  " if r.get("epoch") is not None else "")
                + f"elapsed {hms(r['elapsed_s'])}  eta {hms(r['eta_s'])}  "
                + f"mem/rank {max(mem):.1f} MiB" + (f" (min {min(mem):.1f})" if max(mem) - min(mem) >= 0.05 else ""))
