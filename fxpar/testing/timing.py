"""Timing helpers for the side-by-side benchmarks under ``bench/``."""

from __future__ import annotations

import time

import torch.distributed as dist


def timed(fn):
    """``(seconds, fn())`` measured between two barriers, so every rank's share of a step is inside."""
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out
