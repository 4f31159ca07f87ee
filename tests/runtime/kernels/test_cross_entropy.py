"""Fused linear + vocabulary-parallel cross-entropy (fxpar.runtime.kernels.cross_entropy): loss and
gradients against F.cross_entropy on the whole logits, in one process and with the vocabulary split over
2 gloo ranks; the logits never whole; the collectives per call; the Triton kernels under the Triton
interpreter (a subprocess with TRITON_INTERPRET=1) against the torch path."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.runtime.kernels import cross_entropy as ce
from fxpar.testing import multiproc

pool2 = multiproc.rank_pool(2)
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(tokens=40, hidden=16, vocab=96, seed=0, ignored=(3, 17)):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    y = torch.randint(0, vocab, (tokens,), generator=g)
    y[list(ignored)] = -100
    return h, w, y


def _reference(h, w, y, reduction="mean"):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = F.cross_entropy(h @ w.T, y, reduction=reduction)
    (loss if reduction != "none" else loss * torch.linspace(0.5, 2, len(y))).sum().backward()
    return loss.detach(), h.grad, w.grad


def _fused(h, w, y, reduction="mean", **kw):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ce.linear_cross_entropy(h, w, y, reduction=reduction, **kw)
    (loss if reduction != "none" else loss * torch.linspace(0.5, 2, len(y))).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk", [0, 1, 7, 40, 64])
def test_equals_torch_cross_entropy(chunk, reduction):
    h, w, y = _data()
    for got, want, what in zip(_fused(h, w, y, reduction, chunk=chunk), _reference(h, w, y, reduction),
                               ("loss", "dh", "dW")):
        torch.testing.assert_close(got, want, **TOL, msg=f"{what}, chunk {chunk}, {reduction}")


def test_leading_dims_and_ignore_index():
    h, w, y = _data(tokens=24)
    y[y == -100] = 1
    y[[5, 11]] = 7
    loss = ce.linear_cross_entropy(h.view(4, 6, -1), w, y.view(4, 6), ignore_index=7, chunk=5)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, y, ignore_index=7), **TOL)
    per_token = ce.linear_cross_entropy(h.view(4, 6, -1), w, y.view(4, 6), ignore_index=7, reduction="none")
    assert per_token.shape == (4, 6) and per_token.view(-1)[[5, 11]].eq(0).all()
    # every token ignored: a zero sum with zero gradients, a NaN mean as torch gives
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    total = ce.linear_cross_entropy(h2, w2, torch.full_like(y, -100), reduction="sum")
    total.backward()
    assert total.item() == 0 and not h2.grad.any() and not w2.grad.any()
    assert ce.linear_cross_entropy(h, w, torch.full_like(y, -100)).isnan()


def test_lse_output_and_its_gradient():
    """The op's second output is the log-sum-exp; a loss reading it (a z-loss) gets its gradient."""
    h, w, y = _data()
    a, b = torch.rand(len(y)), torch.rand(len(y))
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lse = torch.ops.fxpar_kernels.linear_cross_entropy(h1, w1, y, 0, None, -100, 6, True)
    ((loss * a).sum() + (lse**2 * b).sum()).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h2 @ w2.T
    want_loss, want_lse = F.cross_entropy(logits, y, reduction="none"), logits.logsumexp(-1)
    ((want_loss * a).sum() + (want_lse**2 * b).sum()).backward()
    for got, want in ((loss, want_loss), (lse, want_lse), (h1.grad, h2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(got.detach(), want.detach(), **TOL)


def test_a_frozen_head_gets_no_gradient_and_its_buffer_is_never_made():
    """A head that does not require grad (a LoRA's): dh as with a trained head, no dW, and backward never
    allocates the fp32 buffer the size of the head that dW accumulates into."""
    h, w, y = _data(tokens=40, hidden=16, vocab=96)
    _, want_dh, _ = _reference(h, w, y)
    h1 = h.clone().requires_grad_()
    loss = ce.linear_cross_entropy(h1, w, y, chunk=7)
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out
    with Sizes():
        loss.backward()
    torch.testing.assert_close(h1.grad, want_dh, **TOL)
    assert sizes and max(sizes) < w.numel(), sorted(sizes)[-3:]  # the largest: a chunk's logits (7 x 96)
    _, _, dw = _fused(h, w, y, chunk=7)  # the same op with a trained head still makes dW
    assert dw is not None and dw.shape == w.shape


def test_low_precision_inputs():
    """bf16 hidden states and weight: bf16 matmuls, fp32 softmax and dW sums; an fp32 loss, bf16 gradients."""
    h, w, y = _data()
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss = ce.linear_cross_entropy(hb, wb, y, chunk=7)
    loss.backward()
    assert loss.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    want = _reference(hb.detach().float(), wb.detach().float(), y)
    for got, ref in zip((loss.detach(), hb.grad.float(), wb.grad.float()), want):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3)


class _Largest(TorchDispatchMode):
    """The largest tensor any ATen op makes, seeing inside fxpar_kernels ops (run as plain functions)."""

    def __init__(self):
        super().__init__()
        self.largest, self.fused = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        impl = ce.python_kernels().get(func)
        if impl is not None:
            self.fused += 1
            with self:
                return impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_logits_are_never_whole():
    tokens, vocab, chunk = 64, 256, 16
    h, w, y = _data(tokens=tokens, hidden=8, vocab=vocab)
    with _Largest() as seen:
        _fused(h, w, y, chunk=chunk)
    assert seen.fused == 2  # forward and backward ran inside the mode
    assert seen.largest == chunk * vocab  # one chunk's logits, never [tokens, vocab]
    with _Largest() as seen:
        _reference(h, w, y)
    assert seen.largest == tokens * vocab  # the check can see whole logits where they exist


def test_auto_chunk_size():
    assert ce.chunk_tokens(16384, 1024, 16384) == 1024  # the chunk's logits as large as the hidden states
    assert ce.chunk_tokens(4096, 1024, 16384) == ce.MIN_CHUNK_TOKENS == 512  # not fewer tokens than this
    assert ce.chunk_tokens(10, 4, 1000) == 10
    assert ce.chunk_tokens(100, 4, 1 << 20) == 100
    assert ce.chunk_tokens(4096, 4, 1 << 20) == 512
    assert ce.chunk_tokens(100, 4, 8, chunk=33) == 33


def test_opcheck():
    h, w, y = _data(tokens=12, hidden=8, vocab=20, ignored=(3,))
    torch.library.opcheck(torch.ops.fxpar_kernels.linear_cross_entropy.default,
                          (h.requires_grad_(), w.requires_grad_(), y, 0, None, -100, 5, True))


# ---------------------------------------------------------------------------------------------------
# Two gloo ranks, the vocabulary split in two


def _two_ranks(vocab, chunk, reduce_grad_hidden):
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    h, w, y = _data(vocab=vocab, seed=1)
    shard = vocab // n
    y[0], y[1] = 0, vocab - 1  # targets at both ends of the vocabulary
    h = h.requires_grad_()
    w_mine = w[rank * shard:(rank + 1) * shard].clone().requires_grad_()
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **kw):
        calls.append(tuple(t.shape))
        return real(t, *a, **kw)

    dist.all_reduce = counting
    try:
        loss = ce.linear_cross_entropy(h, w_mine, y, vocab_start=rank * shard, group="world", chunk=chunk,
                                       reduce_grad_hidden=reduce_grad_hidden)
        forward_calls = list(calls)
        loss.backward()
    finally:
        dist.all_reduce = real
    return loss.detach(), h.grad, w_mine.grad, forward_calls, calls[len(forward_calls):]


@pytest.mark.slow
def test_two_ranks_equal_unsplit(pool2):
    vocab = 96
    h, w, y = _data(vocab=vocab, seed=1)
    y[0], y[1] = 0, vocab - 1
    want_loss, want_dh, want_dw = _reference(h, w, y)
    for reduce_grad_hidden in (True, False):
        ranks = pool2.run(_two_ranks, vocab, 7, reduce_grad_hidden, timeout=120)
        for rank, (loss, dh, dw, fwd, bwd) in enumerate(ranks):
            torch.testing.assert_close(loss, want_loss, **TOL)
            torch.testing.assert_close(dw, want_dw[rank * 48:(rank + 1) * 48], **TOL)
            assert fwd == [(40,), (2, 40)]  # max, then [sum-exp | target logit]: 2 per call, 6 chunks
            assert bwd == ([(40, 16)] if reduce_grad_hidden else [])
            if reduce_grad_hidden:
                torch.testing.assert_close(dh, want_dh, **TOL)
        if not reduce_grad_hidden:  # each rank's share of dh, the sum left to the caller
            torch.testing.assert_close(ranks[0][1] + ranks[1][1], want_dh, **TOL)
            assert not torch.allclose(ranks[0][1], want_dh, **TOL)


# ---------------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter, in a fresh process: TRITON_INTERPRET is read when
# @triton.jit runs, i.e. when the kernel module is imported.

_INTERPRETED = r"""
import torch
from fxpar.runtime.kernels import cross_entropy as ce
from fxpar.runtime.kernels import forced

assert type(ce._stats_kernel).__name__ == "InterpretedFunction", type(ce._stats_kernel)
ce._BLOCK = 128  # several loop steps per row, the last one masked
g = torch.Generator().manual_seed(0)
x = torch.randn(48, 300, generator=g) * 4
tgt = torch.randint(-1, 300, (48,), generator=g)
for got, want in zip(ce.stats_triton(x, tgt), ce.stats_torch(x.clone(), tgt)):
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
lse = x.logsumexp(1)
gl, ga = torch.rand(48, generator=g) * (tgt >= 0), torch.rand(48, generator=g)
torch.testing.assert_close(ce.grad_triton(x.clone(), tgt, lse, gl, ga), ce.grad_torch(x.clone(), tgt, lse, gl, ga),
                           rtol=1e-6, atol=1e-6)

h = torch.randn(40, 16, generator=g)
w = torch.randn(300, 16, generator=g) / 4
y = torch.randint(0, 600, (40,), generator=g)
y[[2, 9]] = -100
def run():
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = ce.linear_cross_entropy(hh, ww, y, vocab_start=150, chunk=16)  # targets in and out of the shard
    loss.backward()
    return loss.detach(), hh.grad, ww.grad
want = run()
calls = []
real = ce.stats_triton
ce.stats_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
with forced("triton"):
    got = run()
assert len(calls) == 3, calls  # the op took the Triton path, one launch per chunk
for a, b in zip(got, want):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("OK")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_kernels_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout + done.stderr


def _peak_above_start(fn, h, w):
    from fxpar.runtime.memtrack import AllocatorPeak

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with AllocatorPeak() as mem:  # the allocator's own figures: nothing about the step changes
        mem.mark()
        fn(hh, ww).backward()
    return mem.peak_without([hh.grad, ww.grad]) - mem.start


def test_fused_loss_holds_one_chunk_of_logits_where_unfused_holds_them_all():
    """Peak bytes of loss + backward (dh and dW left out), fp32 on the CPU: the unfused loss holds the whole
    [tokens, vocab] logits (and their gradient), the fused one one chunk of them at a time."""
    tokens, hidden, vocab = 4096, 32, 2048
    h, w, y = _data(tokens=tokens, hidden=hidden, vocab=vocab, ignored=(5, 99))
    logits = tokens * vocab * 4
    chunk = ce.chunk_tokens(tokens, hidden, vocab)
    assert chunk == ce.MIN_CHUNK_TOKENS < tokens  # 8 chunks
    fused = _peak_above_start(lambda a, b: ce.linear_cross_entropy(a, b, y), h, w)
    unfused = _peak_above_start(lambda a, b: F.cross_entropy(a @ b.T, y), h, w)
    assert unfused >= 2 * logits  # the logits and their softmax gradient, at least
    assert fused <= 2 * chunk * vocab * 4 + 4 * vocab * hidden * 4 + tokens * 64, (fused, chunk)
    assert fused / unfused <= 0.2, (fused, unfused)
