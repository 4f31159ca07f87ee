"""``PeakMemory``: the peak of live tensor storage bytes in a region, checked against bytes counted by hand
from the shapes of a small forward and backward (what autograd keeps, what each op makes, what is freed);
views counted once, storages freed inside the region released, the baseline and exclusions honoured.
``AllocatorPeak`` and ``RssPeak``: a step's peak as it runs unwatched, by hand count and by RSS, where a
dispatch mode (PeakMemory's, or a no-op one) makes the step allocate more."""

from __future__ import annotations

import contextlib
import functools
import gc

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.runtime.memtrack import PeakMemory, live_tensors, storage_bytes

F = 4  # bytes of a float32


def test_matmul_relu_backward_by_hand():
    w = torch.randn(256, 128, requires_grad=True)
    x = torch.randn(64, 256)
    with PeakMemory(baseline=[w, x]) as mem:
        y = x @ w  # 64 x 128, alive while the name holds it
        z = torch.relu(y)  # 64 x 128, saved by relu for backward
        loss = z.sum()  # a scalar
        loss.backward()  # ones (a scalar expanded), relu's gradient 64 x 128, then w.grad 256 x 128
        del y, z, loss
    held = (256 * 128 + 64 * 256) * F
    assert mem.start == held
    act = 64 * 128 * F
    # at w.grad's making: y, z, the gradient of z's relu, the loss and its seed gradient are all alive
    assert mem.peak == held + 3 * act + 256 * 128 * F + 2 * F
    assert mem.peak_held == held and mem.peak_new == mem.peak - held
    assert mem.end == held + w.grad.nbytes  # everything else freed; the gradient stays


def test_views_counted_once_and_frees_released():
    keep = torch.zeros(10)
    with PeakMemory(baseline=[keep]) as mem:
        a = torch.empty(1000)
        views = [a.view(10, 100), a[3:], a.unsqueeze(0).t()]
        del a, views  # freed: 1000 floats back
        b = torch.empty(300)
        b.resize_(700)  # grown in place: counted at its new size
    assert mem.start == 10 * F
    assert mem.peak == (10 + 1000) * F
    assert mem.end == (10 + 700) * F
    del b


def test_default_baseline_and_exclude():
    big = torch.empty(5000)
    other = torch.empty(100)
    # the collector off from here to the region's entry: garbage from earlier tests of this process (a
    # tensor in a reference cycle) freed in between would change the baseline (seen: 24 bytes)
    gc.collect()
    gc.disable()
    try:
        rest = storage_bytes(t for t in live_tensors() if t is not big)  # everything alive but big
        with PeakMemory(exclude=[big]) as mem:
            big.add_(1.0)  # excluded: ignored even when an op writes it
            c = other * 2
    finally:
        gc.enable()
    assert mem.peak - mem.start == c.nbytes
    assert mem.start == rest
    with PeakMemory(baseline=[]) as mem:  # nothing held: tensors alive on entry never count
        d = other + big.sum()
    assert (mem.start, mem.peak) == (0, d.nbytes + F)  # the sum's scalar and d


def test_adamw_step_states():
    """An optimizer step: AdamW makes two states per parameter entry (and a scalar step count)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    lin(torch.randn(8, 64)).sum().backward()
    n = lin.weight.numel() * F
    with PeakMemory(baseline=[lin.weight, lin.weight.grad]) as mem:
        opt.step()
    assert mem.start == 2 * n
    assert mem.end == 4 * n + F  # exp_avg, exp_avg_sq, and the step count
    assert mem.peak >= mem.end


def _profiled_peak(fn) -> int:
    """The most bytes allocated at once while ``fn`` runs, above what was allocated before, from torch
    profiler's memory timeline (allocator events, an independent record of every storage made and freed)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    current = peak = 0
    for t, action, _, size in sorted(MemoryProfileTimeline(prof._memory_profile()).timeline, key=lambda x: x[0]):
        if t >= 0 and action in (Action.CREATE, Action.DESTROY):
            current += size if action == Action.CREATE else -size
            peak = max(peak, current)
    return peak


def test_training_step_matches_profiler():
    """A Llama's training step (forward, loss, backward, AdamW): the peak above the start is the profiler's
    (no tensor alive on entry is freed inside: gradients start unset), up to the scalars torch wraps Python
    numbers in for one op, which only the allocator sees (a few bytes)."""
    from fxpar import zoo

    model = zoo.build("llama", seed=0, num_hidden_layers=1)
    batch = zoo.example_inputs("llama", model, batch=2, seq=16)
    opt = torch.optim.AdamW(model.parameters())

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer states exist from here on
    gc.collect()  # garbage an earlier test of this process left must not be freed inside the measured step
    with PeakMemory() as mem:
        step()
    assert mem.end == mem.start
    profiled = _profiled_peak(step)
    assert profiled > 0 and abs(mem.peak - mem.start - profiled) <= 64


def test_allocator_peak_counts_what_the_warm_up_left_and_frees():
    """AllocatorPeak: a region after a warm-up under the same profiler, so the free of a block the warm-up
    made is seen; its peak equals PeakMemory's on a training step whose gradients (made by the warm-up)
    are dropped inside the region, and bytes counted by hand on a small case."""
    from fxpar import zoo
    from fxpar.runtime.memtrack import AllocatorPeak

    kept = torch.zeros(1000)
    with AllocatorPeak() as mem:
        a = torch.zeros(250_000)  # 1 MB made by the warm-up
        mem.mark()
        del a  # freed inside the region: counted down
        b = torch.zeros(500_000)  # 2 MB
        c = b * 2  # 2 MB more: the peak
        del b, c
    # a (alive at the mark, 1 MB) goes, then b and c (2 MB each) are alive together: 3 MB above the start
    # (a few bytes more: the scalar 2 wrapped in a tensor)
    assert 0 <= mem.peak - mem.start - 3 * 10**6 <= 64 and 0 <= mem.end - mem.start + 10**6 <= 64
    assert mem.start >= kept.nbytes + 10**6

    model = zoo.build("llama", seed=0, num_hidden_layers=1)
    batch = zoo.example_inputs("llama", model, batch=2, seq=16)
    opt = torch.optim.AdamW(model.parameters())

    def step():  # the gradients stay from one step to the next, and go when the next begins
        opt.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        opt.step()

    step()
    with AllocatorPeak() as alloc:
        step()
        alloc.mark()
        step()
    with PeakMemory() as mem:
        step()
    assert alloc.start == mem.start and abs(alloc.peak - mem.peak) <= 64 and abs(alloc.end - mem.end) <= 64


class _NoOpMode(TorchDispatchMode):
    """A dispatch mode that changes nothing an op does: only its presence differs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


N = 10 * 2**20  # floats: 40 MiB, above glibc's largest mmap threshold, so each block comes from the system


def _gather_step(x0, idx, keep: list | None = None):
    """A leaf made from ``x0`` (N floats), 10 of its elements gathered and summed, backward: the leaf and
    its gradient (a zeroed buffer scattered into, in place) are the step's only large blocks."""
    x = x0.clone().requires_grad_()
    x.gather(0, idx).sum().backward()
    if keep is not None:
        keep.append(x)


def test_allocator_peak_measures_the_step_as_it_runs():
    """The allocator's peak of a step run bare is what the step allocates by hand count and by RSS: the leaf
    and its gradient, 2 x 40 MiB (plus the gathered 10 floats and a few scalars); without the gradient kept
    at the end (``peak_without``), the leaf alone. A dispatch mode, however idle, makes the gather's
    backward allocate its gradient twice (out of place), which the allocator sees (3 x 40 MiB) and which
    PeakMemory, itself a dispatch mode, cannot help but measure."""
    from fxpar.runtime.memtrack import AllocatorPeak, RssPeak

    x0, idx, kept = torch.randn(N), torch.arange(10), []
    step = functools.partial(_gather_step, x0, idx)

    def allocator(mode=None):
        with AllocatorPeak() as mem:
            step()
            mem.mark()
            with mode or contextlib.nullcontext():
                step(kept)
        return mem

    bare = allocator()
    assert 0 <= bare.peak - bare.start - 2 * N * F <= 256
    assert 0 <= bare.peak_without([kept[0].grad]) - bare.start - N * F <= 256
    assert 0 <= bare.end - bare.start - 2 * N * F <= 256  # the kept leaf and its gradient
    kept.clear()
    moded = allocator(_NoOpMode())
    assert 0 <= moded.peak - moded.start - 3 * N * F <= 256
    kept.clear()
    with RssPeak() as rss:
        step()
    assert abs(rss.peak - 2 * N * F) <= 4 * 2**20, rss.peak / 2**20
    with PeakMemory() as mem:
        step()
    assert 0 <= mem.peak - mem.start - 3 * N * F <= 256
