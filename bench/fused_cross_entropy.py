"""Fused linear + vocabulary-parallel cross-entropy: peak memory and step time against the unfused loss.

    python bench/fused_cross_entropy.py [--tokens 4096] [--vocab 32768] [--hidden 1024] [--tp 2] [--steps 3]
                                        [--write docs/benchmarks.md]

Hidden states ``h [tokens, hidden]`` (replicated over the TP ranks) and an output head ``W [vocab, hidden]``
split by vocabulary rows over ``tp`` gloo ranks (one process when tp is 1), fp32 on CPU, one torch thread
per rank, mean cross-entropy with a few labels ignored. A step is the loss and its backward (dh, dW).

* fused: ``fxpar.runtime.kernels.cross_entropy.linear_cross_entropy`` (tokens in chunks, logits of one
  chunk at a time, recomputed in backward).
* unfused: ``logits = h @ W_shard.T`` then, for tp > 1, the vocabulary-parallel loss as fxpar's TP loss
  rule writes it (``passes/tensor_parallel/rules/loss.py``: the max, the sum of exponentials and the
  target logit all-reduced with ``torch.ops.fxpar.all_reduce``; ``h`` enters through
  ``identity_fwd_all_reduce_bwd`` so that dh is summed over the ranks, as the fused op does inside);
  ``F.cross_entropy`` for tp = 1.

Peak memory, above what is alive when the step starts (h, W and the labels), dh and dW included: by the
allocator (:class:`fxpar.runtime.memtrack.AllocatorPeak`, the torch profiler's memory events, which change
nothing about how kernels allocate; the ``no grads`` column leaves dh and dW out from their making), and by
the process's resident size (:class:`~fxpar.runtime.memtrack.RssPeak`, a second step) as a cross-check
from above. For the record, a third step under the storage tracker of ``bench/recompute.py`` (a
``TorchDispatchMode``, here also stepping inside the fused op): a dispatch mode turns some of torch's
in-place backward formulas out of place, so its figure is higher than what the step allocates when
nothing watches (the ``dispatch mode`` columns; the figures docs/benchmarks.md gave before 2026-11-27).
Step time: the median of ``--steps`` steps without any of these, the two paths interleaved.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _docs import replace_section  # noqa: E402
from recompute import StorageTracker  # noqa: E402

from fxpar.runtime.kernels import cross_entropy as ce  # noqa: E402
from fxpar.runtime.memtrack import AllocatorPeak, RssPeak  # noqa: E402

SECTION = "## Fused linear + cross-entropy"
DATE = "2026-11-27"
IGNORED = 64  # labels set to -100
MB = 2**20
BUSY = " (the machine was shared with other jobs: load above its core count)"


class InsideTracker(StorageTracker):
    """The storage tracker, run inside fxpar_kernels ops too (their kernels called as functions)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = ce.python_kernels().get(func)
        if impl is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self:
            return impl(*args, **(kwargs or {}))


def _data(tokens: int, vocab: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[torch.randperm(tokens, generator=g)[:IGNORED]] = -100
    return h, w, y


def unfused_loss(h, w, y, start: int, group: str | None):
    """The loss without fusion: whole logits, then torch's loss (one rank) or fxpar's vocab-parallel one."""
    if group is None:
        return F.cross_entropy(h @ w.T, y)
    ops = torch.ops.fxpar
    x = (ops.identity_fwd_all_reduce_bwd(h, group) @ w.T).float()
    top = ops.all_reduce(x.detach().amax(-1), group, "max")
    shifted = x - top.unsqueeze(-1)
    sumexp = ops.all_reduce(shifted.exp().sum(-1), group)
    local = y - start
    inside = (local >= 0) & (local < w.shape[0])
    picked = shifted.gather(1, local.masked_fill(~inside, 0).unsqueeze(-1)).squeeze(-1)
    picked = ops.all_reduce(picked * inside, group)
    valid = y != -100
    return ((sumexp.log() - picked) * valid).sum() / valid.sum()


def measure_memory(fn, h, w) -> dict:
    """One step of ``fn`` (loss and backward) three times: under the allocator's watch, by RSS, under the
    dispatch-mode tracker; bytes above what is alive when each starts."""
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with AllocatorPeak() as mem:  # no warm-up: the step frees nothing made before it
        mem.mark()
        loss = fn(hh, ww)
        loss.backward()
    out = {"peak": mem.peak - mem.start, "peak_no_grads": mem.peak_without([hh.grad, ww.grad]) - mem.start,
           "loss": loss.item(), "dh": hh.grad, "dw": ww.grad, "times": []}
    del loss
    hh.grad = ww.grad = None
    with RssPeak() as rss:
        fn(hh, ww).backward()
    out["rss"] = rss.peak
    hh.grad = ww.grad = None
    with InsideTracker() as tracker:
        fn(hh, ww).backward()
    grads = {StorageWeakRef(t.grad.untyped_storage()).cdata for t in (hh, ww)}
    out.update(dispatch=tracker.peak(), dispatch_no_grads=tracker.peak(grads))
    return out


def bench_rank(tokens: int, vocab: int, hidden: int, steps: int) -> dict:
    import torch.distributed as dist

    import fxpar.runtime.collectives  # noqa: F401  (the kernels of torch.ops.fxpar.*)

    torch.set_num_threads(1)
    tp = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if tp > 1 else 0
    group = "world" if tp > 1 else None
    h, w, y = _data(tokens, vocab, hidden)
    shard = vocab // tp
    w = w[rank * shard:(rank + 1) * shard].clone()
    paths = {
        "unfused": lambda hh, ww: unfused_loss(hh, ww, y, rank * shard, group),
        "fused": lambda hh, ww: ce.linear_cross_entropy(hh, ww, y, vocab_start=rank * shard, group=group),
    }
    out = {name: measure_memory(fn, h, w) for name, fn in paths.items()}
    for _ in range(steps):
        for name, fn in paths.items():
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            t0 = time.perf_counter()
            fn(hh, ww).backward()
            out[name]["times"].append(time.perf_counter() - t0)
    f, u = out["fused"], out["unfused"]
    keys = ("peak", "peak_no_grads", "rss", "dispatch", "dispatch_no_grads", "loss", "times")
    return {"runs": {k: {x: v[x] for x in keys} for k, v in out.items()},
            "chunk": ce.chunk_tokens(tokens, hidden, shard),
            "diff": {"loss": abs(f["loss"] - u["loss"]), "dh": (f["dh"] - u["dh"]).abs().max().item(),
                     "dw": (f["dw"] - u["dw"]).abs().max().item()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tp", default="2", help="comma-separated TP degrees (more than 1: gloo ranks)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write", default=None, help="replace (or append) the section in this markdown file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    started = time.strftime("%H:%M UTC", time.gmtime())
    rows, lines, failures = [], [], []
    for tp in [int(t) for t in a.tp.split(",")]:
        if tp == 1:
            ranks = [bench_rank(a.tokens, a.vocab, a.hidden, a.steps)]
        else:
            from fxpar.testing.multiproc import RankPool

            with RankPool(tp) as pool:
                ranks = pool.run(bench_rank, a.tokens, a.vocab, a.hidden, a.steps, timeout=3000)
        for rank, r in enumerate(ranks):
            u, f = r["runs"]["unfused"], r["runs"]["fused"]
            tu, tf = statistics.median(u["times"]), statistics.median(f["times"])
            ratio, d = f["peak"] / u["peak"], r["diff"]
            rows.append(f"| {tp} | {rank} | {r['chunk']} | {u['peak'] / MB:.1f} | {f['peak'] / MB:.1f} | "
                        f"{ratio:.3f} | {u['peak_no_grads'] / MB:.1f} | {f['peak_no_grads'] / MB:.1f} | "
                        f"{u['rss'] / MB:.1f} | {f['rss'] / MB:.1f} | {f['rss'] / u['rss']:.3f} | "
                        f"{u['dispatch'] / MB:.1f} | {f['dispatch'] / MB:.1f} | {f['dispatch'] / u['dispatch']:.3f} | "
                        f"{tu * 1e3:.0f} | {tf * 1e3:.0f} | {tf / tu:.2f} | {u['loss']:.6f} | "
                        f"{d['loss']:.1e} / {d['dh']:.1e} / {d['dw']:.1e} |")
            if rank == 0:
                for name, run in (("unfused", u), ("fused", f)):
                    lines.append(f"- tp={tp} rank 0 {name} step times (ms): "
                                 f"{', '.join(f'{x * 1e3:.0f}' for x in run['times'])}")
            if ratio > 0.25 or max(d.values()) > 1e-5:
                failures.append((tp, rank, ratio, d))
    cmd = "python bench/fused_cross_entropy.py" + "".join(
        f" --{k} {v}" for k, v in (("tokens", a.tokens), ("vocab", a.vocab), ("hidden", a.hidden), ("tp", a.tp),
                                   ("steps", a.steps)))
    text = "\n".join([
        f"\n{SECTION}\n",
        f"{DATE}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; `{cmd}`.\n",
        f"Loss and backward (dh, dW) of a [{a.tokens}, {a.hidden}] hidden state through an output head of "
        f"vocabulary {a.vocab} split by rows over tp ranks (gloo, one torch thread each), fp32 on CPU, mean "
        f"cross-entropy with {IGNORED} labels ignored. Unfused: the whole [tokens, vocab/tp] logits, then "
        "fxpar's vocabulary-parallel loss (the TP loss rule's ops; `F.cross_entropy` at tp=1). Fused: "
        "`fxpar_kernels::linear_cross_entropy`, tokens in chunks (column `chunk`), 2 all-reduces per "
        "forward and 1 (dh) per backward, logits recomputed chunk by chunk in backward. Peak (MiB, above what "
        "is alive when the step starts, dh and dW included): by the allocator (`fxpar.runtime.memtrack."
        "AllocatorPeak`, the torch profiler's memory events, which perturb nothing; the `no grads` columns "
        "leave dh and dW out), the figure to read; by RSS (`RssPeak`: peak resident size above the step's "
        "start, C heap trimmed first, everything the process touches), a cross-check from above; and under "
        "a dispatch mode (`bench/recompute.py`'s storage tracker, also run inside the fused op; the method "
        "of this section's figures before 2026-11-27): a dispatch mode turns some in-place backward formulas "
        "out of place, so the unfused path's figure is a logits-sized tensor too high. Each is one more step "
        f"of its own. Step time: median of {a.steps} steps, the paths interleaved. 1-minute load average "
        f"{load:.1f} at {started}, {os.getloadavg()[0]:.1f} after"
        f"{BUSY if max(load, os.getloadavg()[0]) > (os.cpu_count() or 1) else ''}. "
        "Differences: fused against unfused, |loss| / max |dh| / max |dW|.\n",
        "| tp | rank | chunk | unfused peak MiB | fused peak MiB | fused / unfused | unfused no grads MiB | "
        "fused no grads MiB | unfused RSS MiB | fused RSS MiB | RSS fused / unfused | unfused dispatch mode MiB | "
        "fused dispatch mode MiB | dispatch mode fused / unfused | unfused ms | fused ms | "
        "fused / unfused time | loss | differences |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The fused path runs four matmuls (the logits again in backward) where the unfused one runs three; "
        "the unfused path's passes over whole [tokens, vocab/tp] fp32 tensors (shift, exp, gather and their "
        "gradients) offset part of that. CPU times only: no GPU figure is claimed.",
        "",
        *lines,
        "",
    ])
    print(text)
    if a.write:
        replace_section(a.write, SECTION, text)
    if failures:
        print(f"FAIL: fused / unfused peak above 0.25 or a difference above 1e-5: {failures}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
