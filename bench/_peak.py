"""A training step's peak memory on each rank, as the benches measure it (``bench/planner_accuracy.py``).

:func:`measure_peak` runs two steps under :class:`fxpar.runtime.memtrack.AllocatorPeak` (the torch profiler's
memory events, which change nothing about how kernels allocate; the first step lets the profiler see the blocks
the second frees). For a step whose ``model:plan`` name ``CROSS_CHECK`` matches (a regex;
``$FXPAR_MEMORY_CROSS_CHECK`` overrides it), :func:`cross_check` measures two more steps, by RSS
(:class:`~fxpar.runtime.memtrack.RssPeak`: from above, everything the process touches) and under
:class:`~fxpar.runtime.memtrack.PeakMemory` (a dispatch mode, which makes some backward formulas allocate more),
and :func:`print_cross_check` sets the three side by side.
"""

from __future__ import annotations

import gc
import os
import re

import torch.distributed as dist

CROSS_CHECK = re.compile(os.environ.get(
    "FXPAR_MEMORY_CROSS_CHECK",
    r"^(llama:(dp=1|dp=2,zero=3|tp=2|pp=2,microbatches=4,schedule=1f1b|dp=2,tp=2)|moe:ep=2)$"))


def measure_peak(step, name: str) -> dict:
    """Bytes of one ``step`` (called with no argument on every rank of the default group at once):
    ``start`` (tensor storage alive when it starts), ``peak``, ``end``; ``peak_new``: the rise above the start;
    ``cross``: :func:`cross_check`'s figures, for a ``name`` that ``CROSS_CHECK`` matches."""
    from fxpar.runtime.memtrack import AllocatorPeak

    gc.collect()  # what earlier runs left in the process is gone before the baseline is taken
    dist.barrier()
    with AllocatorPeak() as mem:
        step()  # under the profiler: the blocks the measured step frees become known
        mem.mark()
        step()
    dist.barrier()
    out = {**mem.report(), "peak_new": mem.peak - mem.start}
    if CROSS_CHECK.search(name):
        out["cross"] = {"allocator": mem.peak - mem.start, **cross_check(step)}
    return out


def cross_check(step) -> dict:
    """Bytes the same step rises above its start by two other measures, one more step each: ``rss`` (the
    process's peak resident size above its size at the start, C heap trimmed first) and ``dispatch`` (under
    :class:`~fxpar.runtime.memtrack.PeakMemory`, a dispatch mode: perturbed)."""
    from fxpar.runtime.memtrack import PeakMemory, RssPeak

    dist.barrier()
    with RssPeak() as rss:
        step()
    dist.barrier()
    with PeakMemory() as pm:
        step()
    dist.barrier()
    return {"rss": rss.peak, "dispatch": pm.peak - pm.start}


def print_cross_check(measured: dict) -> None:
    """``measured``: ``{(model, plan): {"cross": [per rank: cross_check's dict with "allocator", or None]}}``;
    prints per rank the MiB each step rose above its start by the allocator, by RSS and under the dispatch mode."""
    lines = [f"| {m} | `{p}` | {rank} | {c['allocator'] / 2**20:.1f} | {c['rss'] / 2**20:.1f} | "
             f"{c['dispatch'] / 2**20:.1f} | {(c['rss'] - c['allocator']) / 2**20:+.1f} | "
             f"{(c['dispatch'] - c['allocator']) / 2**20:+.1f} |"
             for (m, p), r in measured.items() for rank, c in enumerate(r.get("cross") or []) if c]
    if lines:
        print("\nPeak memory above the step's start, MiB, three ways (AllocatorPeak: the table's figure):\n\n"
              "| model | plan | rank | AllocatorPeak | RSS | PeakMemory (dispatch mode) | RSS - allocator | "
              "dispatch - allocator |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n", flush=True)
