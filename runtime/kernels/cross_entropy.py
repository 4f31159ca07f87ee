"""Fused linear + vocabulary-parallel cross-entropy: ``torch.ops.fxpar_kernels.linear_cross_entropy``.

Reads: hidden states ``h [T, H]``, this rank's rows of the output head ``W [V/tp, H]`` (vocabulary ids
``vocab_start .. vocab_start + V/tp``), labels ``[T]`` and the name of the TP group (resolved by
:mod:`fxpar.runtime.groups`). Writes: the kernels of the ops :mod:`fxpar.ir.fused_ops` declares
(importing this module registers them).

Why hand-written: the unfused loss holds the ``[T, V/tp]`` logits whole, several times over (the
logits, the shifted logits, their exponentials, the logits' gradient); Inductor fuses the elementwise
work but still materialises the matmul's output. Here tokens go through in chunks of ``C`` rows, so
at most a ``[C, V/tp]`` block of logits exists at any time.

* Forward: for each chunk, ``x = h_c @ W.T`` (fp32), then per token of the shard the max ``m``, the sum
  of ``exp(x - m)`` and the target's logit (where the target falls in the shard). After the last chunk,
  two all-reduces over the group for the whole call, not per chunk: the max, then the sums rescaled to
  it packed with the target logits into one tensor (Megatron packs target logit and sum-exp into one
  all-reduce likewise). Outputs: the per-token loss ``lse - target logit`` (0 where the label is
  ``ignore_index``) and the log-sum-exp ``lse``, both ``[T]`` fp32; reductions are done by the caller.
* Backward recomputes each chunk's logits (one more matmul per chunk) rather than computing gradients
  in the forward and keeping them: the global ``lse`` exists only after the forward's all-reduces, so
  gradients in the forward would need both all-reduces per chunk instead of per call; ``dh`` and
  ``dW`` (fp32, the size of the weight shard) would be held from forward to backward, once per
  microbatch in flight under a pipeline schedule; and a forward without grad (evaluation) would pay for
  them. Per chunk: ``g = softmax(x) * (dloss + dlse) - onehot(target) * dloss``, ``dh_c = g @ W``,
  ``dW += g.T @ h_c``. ``h`` is replicated over the group, so each rank's ``dh`` is a partial sum over
  its vocabulary rows: it is all-reduced inside (``reduce_grad_hidden=True``), or left to the caller
  where the graph already has the all-reduce (Megatron's "f" before a column-parallel linear).
* The matmuls are torch's (cuBLAS on GPU). The per-chunk elementwise work (the statistics, and the
  softmax gradient written in place over the chunk's logits) is a Triton kernel on CUDA tensors and
  torch on any other device (:func:`fxpar.runtime.kernels.use_triton`, op name "linear_cross_entropy";
  ``fxpar.runtime.kernels.forced("triton")`` runs the Triton kernels on CPU tensors under
  ``TRITON_INTERPRET=1``, set before this module is imported, for tests).
* The all-reduces (the forward's two, dh's in backward) are fxpar's ``all_reduce`` op, as every other
  collective of the emitted program: counted, checked and bounded by the group's timeout alike.
"""

from __future__ import annotations

import torch

from fxpar.ir import fused_ops
from fxpar.ir.errors import FxparError
from fxpar.ir.fused_ops import check_linear_cross_entropy
from fxpar.ir.ops import all_reduce
from fxpar.runtime import collectives  # noqa: F401  registers the kernels of fxpar's collective ops
from fxpar.runtime.kernels import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is only declared for Linux x86-64
    triton = None

__all__ = ["chunk_tokens", "linear_cross_entropy", "python_kernels"]

_BLOCK = 2048  # vocabulary columns per Triton loop step


def _use_triton(t: torch.Tensor) -> bool:
    return use_triton("linear_cross_entropy", t.device)


# ---------------------------------------------------------------------------------------------------
# Per-chunk elementwise work: torch path and Triton path, same contract. ``x`` is the chunk's fp32
# logits [C, Vs] (overwritten), ``tgt`` the target's column in the shard or -1 (outside the shard,
# or ignored).


def stats_torch(x: torch.Tensor, tgt: torch.Tensor):
    """Per row: (max, sum of exp(x - max), x at ``tgt`` or 0). Overwrites ``x``."""
    picked = x.gather(1, tgt.clamp_min(0)[:, None]).squeeze(1).masked_fill(tgt < 0, 0.0)
    top = x.amax(1)
    total = x.sub_(top[:, None]).exp_().sum(1)
    return top, total, picked


def grad_torch(x, tgt, lse, g_loss, g_lse):
    """``exp(x - lse) * (g_loss + g_lse)``, minus ``g_loss`` at ``tgt``, written over ``x`` (returned).
    ``g_loss`` is 0 on ignored tokens."""
    x.sub_(lse[:, None]).exp_().mul_((g_loss + g_lse)[:, None])
    rows = (tgt >= 0).nonzero().squeeze(1)
    x[rows, tgt[rows]] -= g_loss[rows]
    return x


if triton is not None:

    @triton.jit
    def _stats_kernel(x_ptr, tgt_ptr, max_ptr, sum_ptr, picked_ptr, n_cols, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        top = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, n_cols, BLOCK):  # online max and rescaled sum over the row
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, axis=0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), axis=0)
            top = new_top
        t = tl.load(tgt_ptr + row)
        picked = tl.load(base + tl.maximum(t, 0), mask=t >= 0, other=0.0).to(tl.float32)
        tl.store(max_ptr + row, top)
        tl.store(sum_ptr + row, total)
        tl.store(picked_ptr + row, picked)

    @triton.jit
    def _grad_kernel(x_ptr, tgt_ptr, lse_ptr, gl_ptr, ga_ptr, n_cols, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        lse = tl.load(lse_ptr + row)
        g_loss = tl.load(gl_ptr + row)
        scale = g_loss + tl.load(ga_ptr + row)
        t = tl.load(tgt_ptr + row)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * scale
            g = tl.where(cols == t, g - g_loss, g)
            tl.store(base + cols, g, mask=mask)


def _block(n_cols: int, block: int | None) -> int:
    return block or min(_BLOCK, triton.next_power_of_2(n_cols))


def stats_triton(x: torch.Tensor, tgt: torch.Tensor, block: int | None = None):
    """The Triton kernel of :func:`stats_torch` (one program per row; ``x`` is left unchanged)."""
    n, v = x.shape
    top, total, picked = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3))
    if n:
        _stats_kernel[(n,)](x, tgt, top, total, picked, v, x.stride(0), BLOCK=_block(v, block))
    return top, total, picked


def grad_triton(x, tgt, lse, g_loss, g_lse, block: int | None = None):
    """The Triton kernel of :func:`grad_torch` (one program per row, in place over ``x``)."""
    n, v = x.shape
    if n:
        _grad_kernel[(n,)](x, tgt, lse.contiguous(), g_loss.contiguous(), g_lse.contiguous(), v, x.stride(0),
                           BLOCK=_block(v, block))
    return x


# ---------------------------------------------------------------------------------------------------
# The op


# Fewest tokens per chunk. Each chunk runs its own three matmuls with the chunk's tokens as one dimension
# (the dW matmul's inner one); measured on an H100 (bf16, 4096 tokens, hidden 4096, vocabulary 128,256,
# docs/benchmarks.md "GPU checks"): 130-token chunks took 4.9x the unfused loss's time, 512-token chunks
# 1.9x (1.65x with dW accumulated as below), one chunk of all 4,096 1.3x; against the 130-token chunks
# the peak grew by 3% at 512 tokens and by 64% at 4,096. A 512-token chunk's logits are 1/8 of the whole.
MIN_CHUNK_TOKENS = 512


def chunk_tokens(tokens: int, hidden: int, vocab_shard: int, chunk: int = 0) -> int:
    """Tokens per chunk: ``chunk`` if given, else as many as keep a chunk's logits no larger than the
    hidden states themselves (at least 2**18 elements), and at least :data:`MIN_CHUNK_TOKENS`."""
    if chunk > 0:
        return min(chunk, max(tokens, 1))
    by_size = max(tokens * hidden, 1 << 18) // max(vocab_shard, 1)
    return max(1, min(tokens, max(by_size, MIN_CHUNK_TOKENS)))


def _accumulate_dw(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``dw += g.T @ h`` into the fp32 ``dw`` for low-precision ``g`` and ``h``. On CUDA one matmul with
    fp32 output (``addmm(out_dtype=)``); a bf16 product then a separate fp32 add (the fallback, and the
    only way on CPU) cost an extra pass over ``dw`` per chunk: 2.1 ms of 3.0 per chunk of 512 tokens
    for a 128,256 x 4,096 head on an H100."""
    if dw.is_cuda:
        try:
            torch.addmm(dw, g.t(), h, out_dtype=torch.float32, out=dw)
            return
        except (TypeError, NotImplementedError):  # a torch without the mixed-dtype addmm
            pass
    dw += torch.mm(g.t(), h)


def _local_targets(labels, vocab_start, vocab_shard, ignore_index):
    local = labels.long() - vocab_start
    inside = (local >= 0) & (local < vocab_shard) & (labels != ignore_index)
    return torch.where(inside, local, -1)


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(h, weight.t()).float()  # a fresh fp32 block: the kernels may overwrite it


def _chunks(tokens: int, size: int):
    return ((a, min(a + size, tokens)) for a in range(0, tokens, size))


def forward_impl(hidden, weight, labels, vocab_start, group, ignore_index, chunk, reduce_grad_hidden):
    """The forward op's kernel as a plain function (a memory tracker calls it to see inside the op)."""
    check_linear_cross_entropy(hidden, weight, labels)
    shape, hidden, labels = labels.shape, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    tokens, shard = hidden.shape[0], weight.shape[0]
    tgt = _local_targets(labels, vocab_start, shard, ignore_index)
    top, total, picked = (torch.empty(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3))
    stats = stats_triton if _use_triton(hidden) else stats_torch
    for a, b in _chunks(tokens, chunk_tokens(tokens, hidden.shape[1], shard, chunk)):
        top[a:b], total[a:b], picked[a:b] = stats(_logits(hidden[a:b], weight), tgt[a:b])
    if group:
        top_all = all_reduce(top, group, "max")
        packed = all_reduce(torch.stack([total * torch.exp(top - top_all), picked]), group)  # both in one
        top, total, picked = top_all, packed[0], packed[1]
    lse = top + torch.log(total)
    loss = (lse - picked).masked_fill(labels == ignore_index, 0.0)
    return loss.view(shape), lse.view(shape)


def backward_impl(hidden, weight, labels, lse, grad_loss, grad_lse, vocab_start, group, ignore_index, chunk,
                  reduce_grad_hidden, weight_grad=True):
    """The backward op's kernel as a plain function: (dh, dW); dW ``[0, H]`` unless ``weight_grad``."""
    shape = hidden.shape
    hidden, labels = hidden.reshape(-1, shape[-1]), labels.reshape(-1)
    lse, grad_loss, grad_lse = lse.reshape(-1), grad_loss.reshape(-1), grad_lse.reshape(-1)
    tokens, shard = hidden.shape[0], weight.shape[0]
    tgt = _local_targets(labels, vocab_start, shard, ignore_index)
    g_loss = grad_loss.float().masked_fill(labels == ignore_index, 0.0)
    g_lse = grad_lse.float()
    grad = grad_triton if _use_triton(hidden) else grad_torch
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    dw = torch.zeros(weight.shape if weight_grad else (0, weight.shape[1]), dtype=torch.float32,
                     device=weight.device)
    for a, b in _chunks(tokens, chunk_tokens(tokens, hidden.shape[1], shard, chunk)):
        g = grad(_logits(hidden[a:b], weight), tgt[a:b], lse[a:b], g_loss[a:b], g_lse[a:b])
        if weight.dtype == torch.float32 and hidden.dtype == torch.float32:
            torch.mm(g, weight, out=dh[a:b])
            if weight_grad:
                dw.addmm_(g.t(), hidden[a:b])
        else:  # low-precision matmuls, dW accumulated over chunks in fp32
            g = g.to(weight.dtype)
            dh[a:b] = torch.mm(g, weight)
            if weight_grad:
                _accumulate_dw(dw, g, hidden[a:b].to(weight.dtype))
    if group and reduce_grad_hidden:
        dh = all_reduce(dh, group)
    return dh.view(shape), dw.to(weight.dtype)


# the schemas, fake kernels and autograd formula are fxpar.ir.fused_ops' (passes emit the ops without
# importing the runtime); these are the real kernels, for every device
fused_ops.linear_cross_entropy.register_kernel(None, forward_impl)
fused_ops.linear_cross_entropy_backward.register_kernel(None, backward_impl)
linear_cross_entropy_op = fused_ops.linear_cross_entropy


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         vocab_start: int = 0, group: str | None = None, ignore_index: int = -100,
                         reduction: str = "mean", chunk: int = 0, reduce_grad_hidden: bool = True) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` over the whole vocabulary, ``weight``
    being this rank's rows ``vocab_start ..`` of a head split over ``group`` (None: one rank holds it
    all), without forming the logits whole. ``hidden`` is ``[..., H]``, ``labels`` its leading shape.
    ``reduction``: "mean" over tokens whose label is not ``ignore_index`` (NaN if there are none, as
    ``F.cross_entropy``), "sum", or "none" (per token, 0 where ignored). ``chunk``: tokens per chunk (0:
    :func:`chunk_tokens` picks). The loss is fp32 whatever the input dtype."""
    if reduction not in ("mean", "sum", "none"):
        raise FxparError(f"linear_cross_entropy: reduction must be mean, sum or none, got {reduction!r}")
    flat = labels.reshape(-1)
    loss, _ = linear_cross_entropy_op(hidden.reshape(-1, hidden.shape[-1]), weight, flat, int(vocab_start),
                                      group, int(ignore_index), int(chunk), bool(reduce_grad_hidden))
    if reduction == "none":
        return loss.view(labels.shape)
    total = loss.sum()
    return total if reduction == "sum" else total / (flat != ignore_index).sum()


def python_kernels() -> dict:
    """Each op overload of this module -> its kernel as a plain Python function."""
    return {torch.ops.fxpar_kernels.linear_cross_entropy.default: forward_impl,
            torch.ops.fxpar_kernels.linear_cross_entropy_backward.default: backward_impl}
